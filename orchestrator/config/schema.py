"""The `orch up` configuration: one frozen pydantic model per component, validated when loaded.

The YAML file maps one to one onto :class:`OrchConfig` (docs/config.md; sections in
:mod:`orchestrator.config.sections`). :meth:`OrchConfig.instances` derives each rank actor's
:class:`rank.config.InstanceConfig` (scheduler sizes from the role's section, the
``kv_transfer`` section, and the platform decided by ``engine.platform``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, Optional

from pydantic import model_validator

from engine.graph import GRAPH_BACKENDS, GraphConfig
from engine.prefill_graph import PREFILL_GRAPH_BACKENDS, PrefillGraphConfig
from engine.platform import AUTO, Platform, platform_for
from orchestrator.config.autoscale import AutoscaleSection
from orchestrator.config.sections import (ClusterSection, DecodeSection, GraphSection,
                                          HealthSection, KVTransferSection, ModelSection,
                                          PrefillGraphSection, PrefillSection, RouterSection,
                                          _cross_field, _Section)
from rank.config import InstanceConfig, ParallelConfig, SchedulerConfig


class OrchConfig(_Section):
    """The whole deployment. Built by :func:`load_config`; frozen."""

    model: ModelSection = ModelSection()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PrefillSection = PrefillSection()
    decode: DecodeSection = DecodeSection()
    kv_transfer: KVTransferSection = KVTransferSection()
    router: RouterSection = RouterSection()
    health: HealthSection = HealthSection()
    autoscale: Optional[AutoscaleSection] = None  # off unless set (docs/scaling.md)
    cluster: ClusterSection = ClusterSection()

    @model_validator(mode="after")
    def _cross_section(self) -> "OrchConfig":
        if self.cluster.device != AUTO or self.kv_transfer.backend != AUTO:
            try:
                platform = self.platform()
            except ValueError as exc:
                raise _cross_field(str(exc)) from None
            _check_graph_backend(self.decode.graph, platform.device_type)
            _check_prefill_graph_backend(self.prefill.graph, platform.device_type)
        _check_prefill_graph(self)
        if self.mode == "colocated" and self.decode.ep and self.decode.graph.enabled:
            # NOTE: graph mode + EP dispatches every step by fixed slots of the largest
            # bucket (engine/expert_parallel.py ep_routed_fixed); prefill chunks exceed them
            raise _cross_field(
                "decode.graph with decode.ep in colocated mode: prefill steps cannot use the "
                "graph buckets' fixed-capacity EP dispatch; turn decode.graph.enabled or "
                "decode.ep off, or run disaggregated")
        if self.autoscale is not None and self.mode != "disaggregated":
            raise _cross_field("autoscale moves P:D and needs mode: disaggregated; remove the "
                               "autoscale section (scale colocated instances with `orch scale`)")
        if self.autoscale is not None and self.router.replicas > 1:
            raise _cross_field("autoscale changes instances live, which router replicas do not "
                               "follow: set router.replicas to 1 or remove the autoscale section")
        if self.mode == "colocated" and self.prefill.cp > 1:
            raise _cross_field(
                f"prefill.cp ({self.prefill.cp}) is for disaggregated prefill instances; "
                "colocated instances are sized by the decode section: set prefill.cp to 1")
        block, max_len = self.kv_transfer.block_size, self.model.max_model_len
        sides = [("decode", self.decode.num_kv_blocks)]
        if self.mode == "disaggregated":
            sides.append(("prefill", self.prefill.num_kv_blocks))
        for side, blocks in sides:
            if blocks * block < max_len:
                need = -(-max_len // block)
                raise _cross_field(
                    f"{side}.num_kv_blocks ({blocks}) x kv_transfer.block_size ({block}) = "
                    f"{blocks * block} tokens < model.max_model_len ({max_len}): one request "
                    f"could never fit; raise {side}.num_kv_blocks to >= {need} or lower "
                    "model.max_model_len")
        if self.router.metrics_port and self.router.metrics_port == self.router.port:
            raise _cross_field(
                f"router.metrics_port ({self.router.metrics_port}) equals router.port: pick "
                "another port for metrics (or leave metrics_port unset)")
        if self.router.http_port and self.router.http_port in (self.router.port,
                                                                self.router.metrics_port):
            raise _cross_field(
                f"router.http_port ({self.router.http_port}) equals router.port or "
                "router.metrics_port: pick another port for the HTTP API")
        return self

    def platform(self) -> Platform:
        """Device and torch.distributed backend (TP groups, KV pairs) of every rank:
        :func:`engine.platform.platform_for` of ``cluster.device`` and
        ``kv_transfer.backend`` (both ``auto``: ``$ORCH_DEVICE``, else detected)."""
        return platform_for(self.cluster.device, self.kv_transfer.backend,
                            keys=("cluster.device", "kv_transfer.backend"))

    def instances(self) -> list[InstanceConfig]:
        """One :class:`InstanceConfig` per instance: prefill-0.., decode-0.. or colocated-0.."""
        roles = ["colocated"] if self.mode == "colocated" else ["prefill", "decode"]
        parallel = {role: self._parallel(role) for role in roles}
        scheduler = {role: self._scheduler(role) for role in roles}
        transfer = self.kv_transfer.transfer_config()
        graph = {role: GraphConfig() if role == "prefill"
                 else self.decode.graph.graph_config(self.decode.max_num_seqs) for role in roles}
        prefill_graph = {role: PrefillGraphConfig() if role == "decode"
                         else self.prefill.graph.graph_config() for role in roles}
        return [InstanceConfig(name=f"{role}-{i}", role=role,
                               checkpoint_dir=str(self.model.checkpoint_dir()),
                               dtype=self.model.dtype, fp8_storage=self.model.fp8_storage,
                               scheduler=scheduler[role],
                               parallel=replace(parallel[role], dp_rank=i), transfer=transfer,
                               graph=graph[role], prefill_graph=prefill_graph[role])
                for role in roles for i in range(self._section(role).dp)]

    def instance_config(self, role: str, index: int) -> InstanceConfig:
        """The config of instance ``{role}-{index}``, also past ``dp`` (an instance added live,
        docs/scaling.md): as :meth:`instances` would make it with ``dp = index + 1``.

        Raises:
            ValueError: ``role`` is not a role of this mode, or ``index`` < 0.
        """
        roles = ["colocated"] if self.mode == "colocated" else ["prefill", "decode"]
        if role not in roles or index < 0:
            raise ValueError(f"no instance {role}-{index} in {self.mode} mode: roles {roles}")
        section = "decode" if role == "colocated" else role
        grown = self.model_copy(update={section: self._section(role).model_copy(
            update={"dp": max(index + 1, self._section(role).dp)})})
        return next(i for i in grown.instances() if i.name == f"{role}-{index}")

    def _section(self, role: str) -> PrefillSection | DecodeSection:
        """The section that sizes ``role``'s instances (colocated ones: ``decode``)."""
        return self.prefill if role == "prefill" else self.decode

    def _scheduler(self, role: str) -> SchedulerConfig:
        """Scheduler sizes of ``role``: prefill's from ``prefill``, decode's from ``decode``
        (one token per request per step), colocated ones from both (chunking from
        ``prefill``, batch and KV size from ``decode``)."""
        block, k = self.kv_transfer.block_size, self.decode.num_speculative_tokens
        max_len = self.model.max_model_len  # NOTE: sizes a V4 rank's group pools
        if role == "prefill":
            p = self.prefill
            return SchedulerConfig(block, p.num_kv_blocks, p.chunk_size,
                                   p.max_num_batched_tokens, p.max_num_seqs,
                                   num_speculative_tokens=k, prefix_cache=p.prefix_cache,
                                   staging_blocks=p.v4_staging_blocks or 0,
                                   max_model_len=max_len)
        d = self.decode
        if role == "decode":  # NOTE: a drafting request computes 1 + k tokens per step
            return SchedulerConfig(block, d.num_kv_blocks, chunk_size=1 + k,
                                   max_num_batched_tokens=d.max_num_seqs * (1 + k),
                                   max_num_seqs=d.max_num_seqs, num_speculative_tokens=k,
                                   prefix_cache=d.prefix_cache,
                                   staging_blocks=d.v4_staging_blocks or 0,
                                   max_model_len=max_len)
        return SchedulerConfig(block, d.num_kv_blocks, self.prefill.chunk_size,
                               self.prefill.max_num_batched_tokens + d.max_num_seqs * k,
                               d.max_num_seqs, num_speculative_tokens=k,
                               prefix_cache=d.prefix_cache, max_model_len=max_len)

    def _parallel(self, role: str) -> ParallelConfig:
        """The role's layout; ``dp_rank`` is set per instance by :meth:`instances`."""
        bind_host = self.cluster.bind_host or ("" if self.cluster.address else "127.0.0.1")
        section = self._section(role)
        cp = dict(cp=section.cp, layer_sharding=tuple(section.layer_sharding)) \
            if role == "prefill" else {}
        platform = self.platform()
        return ParallelConfig(tp=section.tp, dp=section.dp, ep=section.ep, **cp,
                              device=platform.device_type,
                              dist_backend=platform.dist_backend,
                              bind_host=bind_host, step_timeout_s=self.health.step_timeout_s)


def _check_prefill_graph(cfg: "OrchConfig") -> None:
    """prefill.graph where its runners have no capture (engine/prefill_graph.py)."""
    if not cfg.prefill.graph.enabled:
        return
    colocated = cfg.mode == "colocated"
    why = [what for what, bad in (
        ("prefill.cp > 1", cfg.prefill.cp > 1),
        ("decode.ep" if colocated else "prefill.ep", cfg.decode.ep if colocated
         else cfg.prefill.ep),
        ("decode.speculative", cfg.decode.speculative is not None)) if bad]
    if why:
        raise _cross_field(f"prefill.graph does not run with {', '.join(why)}: set "
                           "prefill.graph.enabled false or turn those off")


def _check_prefill_graph_backend(graph: PrefillGraphSection, device: str) -> None:
    if graph.enabled and device not in PREFILL_GRAPH_BACKENDS.device_types(
            graph.backend or None):
        raise _cross_field(
            f"prefill graph mode (prefill.graph) has no implementation on cluster.device "
            f"'{device}' (inductor's dynamic-shape compile runs on "
            f"{PREFILL_GRAPH_BACKENDS.device_types('compile')}): set prefill.graph.enabled "
            "false")


def _check_graph_backend(graph: GraphSection, device: str) -> None:
    if graph.enabled and device not in GRAPH_BACKENDS.device_types(graph.backend or None):
        what = f"decode.graph.backend '{graph.backend}'" if graph.backend else \
            "graph mode (decode.graph.enabled)"
        usable = [n for n in GRAPH_BACKENDS.names() if device in GRAPH_BACKENDS.device_types(n)]
        raise _cross_field(
            f"{what} has no implementation on cluster.device '{device}': set "
            f"decode.graph.backend to one of {usable} (or leave it empty), or "
            "decode.graph.enabled false")

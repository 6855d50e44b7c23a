"""The sections of the `orch up` configuration (one frozen pydantic model per component):
model, prefill, decode, kv_transfer, router (TLS, auth), health, cluster (the graph sections
in orchestrator/config/graph_sections.py). :class:`orchestrator.config.schema.OrchConfig` holds one of each and checks what spans
sections; docs/config.md is the reference for every key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, model_validator

from engine import envs
from engine.layer_sharding import SHARDABLE
from kv_transfer.config import TransferConfig
from orchestrator.config.graph_sections import GraphSection, PrefillGraphSection
# NOTE: _Section and _cross_field are also imported from here (schema.py, autoscale.py)
from orchestrator.config.section_base import _cross_field, _Section
from orchestrator.router.limits import DEFAULT_MAX_MESSAGE_BYTES

class ModelSection(_Section):
    """Which checkpoint to serve and at what precision / context length."""

    path: str = Field("tiny", min_length=1)
    tiny_arch: Literal["deepseek_v3", "deepseek_v32", "glm_moe_dsa",
                       "glm_moe_dsa_shared", "deepseek_v4"] = "deepseek_v3"
    tiny_seed: int = Field(0, ge=0)
    tiny_dir: str = ""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # FP8 checkpoints: dequantize to dtype at load, or keep FP8 weights (docs/quantization.md).
    fp8_storage: Literal["dequantize", "fp8"] = "dequantize"
    max_model_len: int = Field(2048, ge=2)
    # A config.json to plan memory and check tp with when model.path's is not on this machine
    # (a relative path is relative to the YAML file's folder); model.path's wins when present.
    config_json: str = ""

    @property
    def is_tiny(self) -> bool:
        return self.path == "tiny"

    def checkpoint_dir(self) -> Path:
        """The checkpoint folder; for ``tiny``, where the built-in tiny checkpoint lives.

        ``tiny`` resolves to ``tiny_dir`` when set, else ``$ORCH_CACHE_DIR/<name>``, else
        ``~/.cache/orch/<name>``, where ``<name>`` is ``tiny-<seed>`` for ``tiny_arch``
        deepseek_v3 and ``tiny-<arch>-<seed>`` otherwise (NOTE: one folder per arch, so a V3.2
        config never loads a V3 tiny checkpoint made before). Nothing is created here (see
        ``checkpoint.py``).
        """
        if not self.is_tiny:
            return Path(self.path).expanduser()
        if self.tiny_dir:
            return Path(self.tiny_dir).expanduser()
        cache = envs.ORCH_CACHE_DIR.get() or str(Path.home() / ".cache" / "orch")
        arch = "" if self.tiny_arch == "deepseek_v3" else f"{self.tiny_arch}-"
        return Path(cache).expanduser() / f"tiny-{arch}{self.tiny_seed}"


def _check_ep(section: str, ep: bool, dp: int, tp: int) -> None:
    """Expert parallelism needs more than one rank in the role (``tp``: ranks per instance)."""
    if ep and dp * tp == 1:
        raise _cross_field(
            f"{section}.ep is on but {section}.dp x {section}.tp = 1: expert parallelism "
            f"splits the routed experts over the role's dp x tp ranks and needs at least 2; "
            f"raise {section}.dp or {section}.tp, or set {section}.ep false")


def _check_cp(cp: int, tp: int, layer_sharding: list[str]) -> None:
    """Context parallelism replaces TP inside a prefill instance; layer sharding needs CP and
    names only attention linears, each once."""
    if cp > 1 and tp != 1:
        raise _cross_field(
            f"prefill.cp ({cp}) > 1 needs prefill.tp == 1, got {tp}: a context-parallel "
            "instance's ranks each hold all heads; set prefill.tp to 1 (or prefill.cp to 1)")
    if layer_sharding and cp == 1:
        raise _cross_field(
            f"prefill.layer_sharding {layer_sharding} needs prefill.cp > 1: layer sharding "
            "spreads the weights CP replicates; raise prefill.cp or remove layer_sharding")
    repeated = sorted({name for name in layer_sharding if layer_sharding.count(name) > 1})
    if repeated:
        raise _cross_field(
            f"prefill.layer_sharding names {repeated} more than once: each weight is sharded "
            "once (a repeat would be broadcast and counted twice); list each name once")
    unknown = [name for name in layer_sharding if name not in SHARDABLE]
    if unknown:
        raise _cross_field(
            f"prefill.layer_sharding names {unknown}, which are not attention linears: "
            f"choose from {list(SHARDABLE)}")


class PrefillSection(_Section):
    """Prefill instances: ``dp`` instances of ``tp`` ranks (``cp`` ranks with context
    parallelism), chunked prefill sizes; ``ep``: the routed experts split over all dp x tp
    ranks (DESIGN.md "Words")."""

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    # Context parallelism: one prompt's tokens split over cp ranks, each with all heads.
    cp: int = Field(1, ge=1)
    # With cp > 1: attention weights stored on one rank per layer, broadcast ahead of use.
    layer_sharding: list[str] = Field(default_factory=list)
    chunk_size: int = Field(512, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    num_kv_blocks: int = Field(256, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    # DeepSeek-V4 PD only: blocks of the staging rows a request's state ships in (its scheduler
    # pool and staging cache; docs/kv_transfer.md "DeepSeek-V4"); unset: num_kv_blocks.
    v4_staging_blocks: int | None = Field(None, ge=1)
    # Prefix cache: reuse the KV of full blocks already computed for the same tokens.
    prefix_cache: bool = True
    # Expert parallelism: the routed experts split over all dp x tp ranks of the role.
    ep: bool = False
    # Extra Ray resources every prefill rank's bundle asks for, to pin prefill to some nodes
    # (e.g. {"prefill_node": 0.01} with `ray start --resources '{"prefill_node": 1}'`).
    ray_resources: dict[str, float] = Field(default_factory=dict)
    # Graph mode of prefill-only steps (prefill and colocated instances).
    graph: PrefillGraphSection = PrefillGraphSection()

    @model_validator(mode="after")
    def _chunk_fits_batch(self) -> "PrefillSection":
        if self.chunk_size > self.max_num_batched_tokens:
            raise _cross_field(
                f"prefill.chunk_size ({self.chunk_size}) must be <= "
                f"prefill.max_num_batched_tokens ({self.max_num_batched_tokens}): lower "
                "chunk_size or raise max_num_batched_tokens")
        _check_ep("prefill", self.ep, self.dp, self.tp * self.cp)
        _check_cp(self.cp, self.tp, self.layer_sharding)
        return self


class SpeculativeSection(_Section):
    """Speculative decoding (engine/spec_forward.py): ``method`` "mtp" drafts with the
    checkpoint's multi-token-prediction module (``num_nextn_predict_layers`` >= 1);
    ``num_speculative_tokens`` drafts per request per step, verified in one forward (1 matches
    the released weights; more reuse the module on its own output). Prefill instances run the
    MTP module over prompts and ship its KV with the rest."""

    method: Literal["mtp"] = "mtp"
    num_speculative_tokens: int = Field(1, ge=1, le=8)


class DecodeSection(_Section):
    """Decode instances (and, in colocated mode, the colocated instances); ``ep`` as in
    :class:`PrefillSection`."""

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    num_kv_blocks: int = Field(256, ge=1)
    # DeepSeek-V4 PD only (see PrefillSection); a decode holds a request's staging blocks
    # until it ends. Not read by colocated instances.
    v4_staging_blocks: int | None = Field(None, ge=1)
    # Prefix cache (see PrefillSection): finished requests' blocks (a conversation's earlier
    # turns) stay reusable, and prefill ships only the KV decode does not hold.
    prefix_cache: bool = True
    # Expert parallelism (see PrefillSection).
    ep: bool = False
    # Extra Ray resources every decode rank's bundle asks for (see PrefillSection).
    ray_resources: dict[str, float] = Field(default_factory=dict)
    # Graph mode of the decode forward (decode and colocated instances).
    graph: GraphSection = GraphSection()
    # Speculative decoding (MTP); None: off.
    speculative: Optional[SpeculativeSection] = None

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts per request per step (0: speculative decoding off)."""
        return self.speculative.num_speculative_tokens if self.speculative else 0

    @model_validator(mode="after")
    def _ep_needs_ranks(self) -> "DecodeSection":
        _check_ep("decode", self.ep, self.dp, self.tp)
        if self.ep and self.graph.enabled and max(self.graph.batch_sizes) < self.max_num_seqs:
            # NOTE: graph mode + EP: every step uses the fixed-capacity dispatch of the
            # largest bucket (engine/expert_parallel.py ep_routed_fixed)
            raise _cross_field(
                f"decode.graph with decode.ep: the largest bucket "
                f"({max(self.graph.batch_sizes)}) must be >= decode.max_num_seqs "
                f"({self.max_num_seqs}): add {self.max_num_seqs} to decode.graph.batch_sizes")
        return self


class KVTransferSection(_Section):
    """Data plane: dist backend, KV block size and the bounded waits of a transfer (seconds).

    The waits are :class:`kv_transfer.TransferConfig`'s (meaning and defaults declared there);
    :meth:`transfer_config` builds it.
    """

    backend: Literal["auto", "hccl", "nccl", "gloo"] = "auto"
    block_size: int = Field(16, gt=0)
    connect_timeout_s: float = Field(TransferConfig.connect_timeout_s, gt=0)
    header_timeout_s: float = Field(TransferConfig.header_timeout_s, gt=0)
    payload_timeout_s: float = Field(TransferConfig.payload_timeout_s, gt=0)
    completion_timeout_s: float = Field(TransferConfig.completion_timeout_s, gt=0)
    heartbeat_s: float = Field(TransferConfig.heartbeat_s, gt=0)
    peer_timeout_s: float = Field(TransferConfig.peer_timeout_s, gt=0)
    retry_backoff_s: float = Field(TransferConfig.retry_backoff_s, gt=0)
    same_node: Literal["auto", "off"] = TransferConfig.same_node
    layerwise: bool = TransferConfig.layerwise
    # Device memory of ONE TP / EP / CP communicator in MB (10^6 bytes) for the memory plan;
    # None = the backend's default (kv_transfer/backend.py COMM_SETTINGS: HCCL 2 x
    # HCCL_BUFFSIZE = 400 MiB, NCCL ~80 MiB, gloo 0). Set it when you export HCCL_BUFFSIZE.
    comm_buffer_mb: Optional[float] = Field(None, ge=0)

    @model_validator(mode="after")
    def _transfer_rules(self) -> "KVTransferSection":
        # NOTE: the cross-field rules (peer_timeout_s vs heartbeat_s) are TransferConfig's own
        try:
            self.transfer_config()
        except ValueError as exc:
            raise _cross_field(f"kv_transfer: {exc}") from None
        return self

    def transfer_config(self) -> TransferConfig:
        """The :class:`kv_transfer.TransferConfig` every rank's KV connector is built with."""
        return TransferConfig(connect_timeout_s=self.connect_timeout_s,
                              header_timeout_s=self.header_timeout_s,
                              payload_timeout_s=self.payload_timeout_s,
                              completion_timeout_s=self.completion_timeout_s,
                              heartbeat_s=self.heartbeat_s, peer_timeout_s=self.peer_timeout_s,
                              retry_backoff_s=self.retry_backoff_s, same_node=self.same_node,
                              layerwise=self.layerwise)


class TLSSection(_Section):
    """Server TLS: PEM certificate (chain) and its private key (read by orchestrator.api.security)."""

    cert_file: str = Field(min_length=1)
    key_file: str = Field(min_length=1)


class AuthSection(_Section):
    """Bearer token every call but health must carry: from a file or a named env variable."""

    token_file: str = ""
    token_env: str = ""

    @model_validator(mode="after")
    def _one_source(self) -> "AuthSection":
        if bool(self.token_file) == bool(self.token_env):
            raise _cross_field("router.auth needs exactly one of token_file (a file holding "
                               "the token) or token_env (the name of a variable holding it)")
        return self


class RouterSection(_Section):
    """The gRPC front end (and its metrics endpoint and OpenAI HTTP API)."""

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    policy: Literal["round_robin", "least_outstanding_tokens", "kv_aware"] = \
        "least_outstanding_tokens"
    max_pending: int = Field(64, ge=0)
    request_timeout_s: float = Field(120.0, gt=0)
    metrics_host: str = "127.0.0.1"
    max_attempts: int = Field(3, ge=1)
    # Most times one request moves to another decode after tokens streamed (its decode
    # failed or was drained); 0: such a request ends UNAVAILABLE (docs/scaling.md).
    max_migrations: int = Field(3, ge=0)
    # Seconds a removed instance's requests may run before they migrate (docs/scaling.md).
    drain_timeout_s: float = Field(30.0, ge=0)
    # PD: send the prefill call before decode's reservation, which is made while the prompt
    # computes (its KV ships once it arrives); off with V4, MTP or prefill cp > 1.
    eager_prefill: bool = False
    # With eager_prefill: decode's reservation is made once the first token reached the router
    # (streamed to the client at once), not while the prompt computes (docs/router.md).
    reserve_after_first_token: bool = False
    # How the router's leader calls (generate, prefill, reserve, attach, admit, abort) reach
    # the instance leaders: Ray actor calls, or one TCP connection per leader opened over Ray
    # (docs/router.md, "Leader calls"); everything else stays on Ray.
    leader_calls: Literal["ray", "socket"] = "ray"
    metrics_port: Optional[int] = Field(None, ge=0, le=65535)
    # OpenAI-compatible HTTP API on router.host (docs/router.md, HTTP API); None = off.
    http_port: Optional[int] = Field(None, ge=0, le=65535)
    # gRPC's receive limit, bytes; raised to what model.max_model_len needs when lower.
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=4 * 1024 * 1024)
    tls: Optional[TLSSection] = None
    auth: Optional[AuthSection] = None
    # Router processes serving router.port / router.http_port together (SO_REUSEPORT); the
    # first also serves Admin, metrics and health probing (docs/router.md, Router replicas).
    replicas: int = Field(1, ge=1, le=64)

    @model_validator(mode="after")
    def _late_needs_eager(self) -> "RouterSection":
        if self.reserve_after_first_token and not self.eager_prefill:
            raise _cross_field("router.reserve_after_first_token needs router.eager_prefill: "
                               "true (the prefill call goes out before any reservation)")
        return self


class HealthSection(_Section):
    """How the router watches every rank (seconds); see docs/reliability.md.

    Every ``probe_interval_s`` each rank of each instance is pinged, each ping bounded by
    ``probe_timeout_s``, unless the instance's leader reported on its token stream that every
    rank lived within the interval (it beats every ``probe_interval_s / 2``): a dead rank marks
    its instance unhealthy at once, a silent one after ``probe_timeout_s``. ``status_timeout_s`` bounds each instance's answer to ``orch status``.
    An unhealthy instance is restarted (new rank actors) within ``recover_timeout_s``, at most
    ``max_restarts`` times per ``restart_window_s`` (0 turns automatic restarts off); a failed
    or budget-deferred restart is tried again after ``restart_backoff_s``, doubling up to
    ``restart_backoff_max_s`` (and never before the budget allows one).
    ``step_timeout_s`` bounds one SPMD step across an instance's ranks: a rank that answers
    pings but neither finishes nor fails a step within it (e.g. stuck in a collective) takes
    its instance out of service.
    """

    step_timeout_s: float = Field(300.0, gt=0)
    probe_interval_s: float = Field(1.0, gt=0)
    probe_timeout_s: float = Field(5.0, gt=0)
    status_timeout_s: float = Field(2.0, gt=0)
    recover_timeout_s: float = Field(300.0, gt=0)
    max_restarts: int = Field(3, ge=0)
    restart_window_s: float = Field(600.0, gt=0)
    restart_backoff_s: float = Field(5.0, gt=0)
    restart_backoff_max_s: float = Field(300.0, gt=0)


class ClusterSection(_Section):
    """Where ranks run: Ray address ("" = embedded local Ray), device, CPUs per rank."""

    address: str = ""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    cpus_per_rank: float = Field(1.0, gt=0)
    # Share of one accelerator (GPU / NPU) per rank: 1 = a device each; 0.5 = two ranks on
    # one device (prefill and decode on one development GPU). Ignored on cpu.
    accelerators_per_rank: float = Field(1.0, gt=0, le=1)
    startup_timeout_s: float = Field(600.0, gt=0)
    # Address the ranks' rendezvous stores (TP and KV pairs) listen on. "" = 127.0.0.1 with
    # the embedded Ray, else each node's IP as Ray reports it.
    bind_host: str = ""
    # Memory of one device in GB (10^9 bytes) for the memory plan; None = the device type's
    # figure (orchestrator/config/devices.py). On cpu: the memory all ranks share.
    device_memory_gb: Optional[float] = Field(None, gt=0)

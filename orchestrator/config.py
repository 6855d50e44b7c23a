"""The `orch up` configuration: one frozen pydantic model per component, validated when loaded.

The YAML file maps one to one onto :class:`OrchConfig` (reference: docs/config.md).
:func:`load_config` turns every YAML or validation problem into one :class:`ConfigError` whose
message names the key path (``prefill.tp``), what is allowed and what to do.
:meth:`OrchConfig.instances` derives the per-instance :class:`prefill_worker.config.InstanceConfig`
that the rank actors receive: each role's scheduler sizes from that role's section, the one
``kv_transfer.TransferConfig`` from the ``kv_transfer`` section, and the device and backend
decided once by ``engine.platform``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from engine import envs
from engine.graph import GRAPH_BACKENDS, GraphConfig
from engine.layer_sharding import SHARDABLE
from engine.platform import DIST_BACKENDS, detect_platform
from kv_transfer.config import TransferConfig
from orchestrator.config_errors import ConfigError, validation_error_message, yaml_error_message
from orchestrator.limits import DEFAULT_MAX_MESSAGE_BYTES
from prefill_worker.config import InstanceConfig, ParallelConfig, SchedulerConfig

DEVICE_FOR_BACKEND = {backend: device for device, backend in DIST_BACKENDS.items()}


class _Section(BaseModel):
    # NOTE: strict: `tp: true` or `tp: "2"` are errors, not 1 and 2; no inf/nan durations.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _cross_field(message: str) -> PydanticCustomError:
    return PydanticCustomError("cross_field", message)


class ModelSection(_Section):
    """Which checkpoint to serve and at what precision / context length."""

    path: str = Field("tiny", min_length=1)
    tiny_arch: Literal["deepseek_v3", "deepseek_v32"] = "deepseek_v3"
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


class GraphSection(_Section):
    """Graph mode of the decode forward (engine/graph.py): decode-only steps of up to
    ``max(batch_sizes)`` sequences run a forward captured once per batch-size bucket; all
    other steps run eager. vLLM's ``enforce_eager`` is ``enabled: false``, its
    ``cuda_graph_sizes`` is ``batch_sizes``."""

    enabled: bool = False
    batch_sizes: list[int] = Field(default_factory=lambda: list(GraphConfig.batch_sizes),
                                   min_length=1)
    # Capture every bucket when the instance starts (else on a bucket's first use).
    warmup: bool = False
    # Capture backend ("compile", "cudagraph", "npugraph"); "" = the device type's default.
    backend: str = ""

    @model_validator(mode="after")
    def _sizes_increase(self) -> "GraphSection":
        try:
            self.graph_config()
        except ValueError as exc:
            raise _cross_field(f"decode.graph: {exc}") from None
        return self

    def graph_config(self, max_num_seqs: int | None = None) -> GraphConfig:
        """The :class:`engine.graph.GraphConfig` the decode (or colocated) runners get; with
        ``max_num_seqs`` (the instance's batch cap) every bucket above it becomes
        ``max_num_seqs``: no step is padded past the batch cap and warmup captures no bucket
        a step cannot use."""
        sizes = self.batch_sizes if max_num_seqs is None else \
            sorted({min(size, max_num_seqs) for size in self.batch_sizes})
        return GraphConfig(enabled=self.enabled, batch_sizes=tuple(sizes),
                           warmup=self.warmup, backend=self.backend or None)


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
    # Expert parallelism: the routed experts split over all dp x tp ranks of the role.
    ep: bool = False
    # Extra Ray resources every prefill rank's bundle asks for, to pin prefill to some nodes
    # (e.g. {"prefill_node": 0.01} with `ray start --resources '{"prefill_node": 1}'`).
    ray_resources: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _no_graph(cls, data: object) -> object:
        if isinstance(data, dict) and "graph" in data:
            raise _cross_field(
                "prefill.graph: graph mode captures the decode forward only (prefill steps "
                "vary in token count and always run eager); move the graph section to decode "
                "(it also covers colocated instances) or remove it")
        return data

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


class DecodeSection(_Section):
    """Decode instances (and, in colocated mode, the colocated instances); ``ep`` as in
    :class:`PrefillSection`."""

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    num_kv_blocks: int = Field(256, ge=1)
    # Expert parallelism (see PrefillSection).
    ep: bool = False
    # Extra Ray resources every decode rank's bundle asks for (see PrefillSection).
    ray_resources: dict[str, float] = Field(default_factory=dict)
    # Graph mode of the decode forward (decode and colocated instances).
    graph: GraphSection = GraphSection()

    @model_validator(mode="after")
    def _ep_needs_ranks(self) -> "DecodeSection":
        _check_ep("decode", self.ep, self.dp, self.tp)
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
                              retry_backoff_s=self.retry_backoff_s, same_node=self.same_node)


class TLSSection(_Section):
    """Server TLS: PEM certificate (chain) and its private key (read by orchestrator.security)."""

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
    policy: Literal["round_robin", "least_outstanding_tokens"] = "least_outstanding_tokens"
    max_pending: int = Field(64, ge=0)
    request_timeout_s: float = Field(120.0, gt=0)
    metrics_host: str = "127.0.0.1"
    max_attempts: int = Field(3, ge=1)
    metrics_port: Optional[int] = Field(None, ge=0, le=65535)
    # OpenAI-compatible HTTP API on router.host (docs/router.md, HTTP API); None = off.
    http_port: Optional[int] = Field(None, ge=0, le=65535)
    # gRPC's receive limit, bytes; raised to what model.max_model_len needs when lower.
    max_message_bytes: int = Field(DEFAULT_MAX_MESSAGE_BYTES, ge=4 * 1024 * 1024)
    tls: Optional[TLSSection] = None
    auth: Optional[AuthSection] = None


class HealthSection(_Section):
    """How the router watches every rank (seconds); see docs/reliability.md.

    Every ``probe_interval_s`` each rank of each instance is pinged, each ping bounded by
    ``probe_timeout_s``: a dead rank marks its instance unhealthy at once, a silent one after
    ``probe_timeout_s``. ``status_timeout_s`` bounds each instance's answer to ``orch status``.
    An unhealthy instance is restarted (new rank actors) within ``recover_timeout_s``, at most
    ``max_restarts`` times per ``restart_window_s`` (0 turns automatic restarts off).
    """

    probe_interval_s: float = Field(1.0, gt=0)
    probe_timeout_s: float = Field(5.0, gt=0)
    status_timeout_s: float = Field(2.0, gt=0)
    recover_timeout_s: float = Field(300.0, gt=0)
    max_restarts: int = Field(3, ge=0)
    restart_window_s: float = Field(600.0, gt=0)


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
    # figure (orchestrator/devices.py). On cpu: the memory all ranks share.
    device_memory_gb: Optional[float] = Field(None, gt=0)


class OrchConfig(_Section):
    """The whole deployment. Built by :func:`load_config`; frozen."""

    model: ModelSection = ModelSection()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PrefillSection = PrefillSection()
    decode: DecodeSection = DecodeSection()
    kv_transfer: KVTransferSection = KVTransferSection()
    router: RouterSection = RouterSection()
    health: HealthSection = HealthSection()
    cluster: ClusterSection = ClusterSection()

    @model_validator(mode="after")
    def _cross_section(self) -> "OrchConfig":
        _check_backend(self.kv_transfer.backend, self.cluster.device)
        if self.cluster.device != "auto" or self.kv_transfer.backend != "auto":
            _check_graph_backend(self.decode.graph, self.device())
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

    def device(self) -> str:
        """The rank device: ``cluster.device``, or derived from the backend, or
        ``engine.platform``'s decision (``$ORCH_DEVICE``, else detected)."""
        if self.cluster.device != "auto":
            return self.cluster.device
        if self.kv_transfer.backend != "auto":
            return DEVICE_FOR_BACKEND[self.kv_transfer.backend]
        return detect_platform().device_type

    def dist_backend(self) -> str:
        """torch.distributed backend for TP groups and KV pairs."""
        if self.kv_transfer.backend != "auto":
            return self.kv_transfer.backend
        return DIST_BACKENDS[self.device()]

    def instances(self) -> list[InstanceConfig]:
        """One :class:`InstanceConfig` per instance: prefill-0.., decode-0.. or colocated-0.."""
        roles = ["colocated"] if self.mode == "colocated" else ["prefill", "decode"]
        parallel = {role: self._parallel(role) for role in roles}
        scheduler = {role: self._scheduler(role) for role in roles}
        transfer = self.kv_transfer.transfer_config()
        graph = {role: GraphConfig() if role == "prefill"
                 else self.decode.graph.graph_config(self.decode.max_num_seqs) for role in roles}
        return [InstanceConfig(name=f"{role}-{i}", role=role,
                               checkpoint_dir=str(self.model.checkpoint_dir()),
                               dtype=self.model.dtype, fp8_storage=self.model.fp8_storage,
                               scheduler=scheduler[role],
                               parallel=replace(parallel[role], dp_rank=i), transfer=transfer,
                               graph=graph[role])
                for role in roles for i in range(self._section(role).dp)]

    def _section(self, role: str) -> PrefillSection | DecodeSection:
        """The section that sizes ``role``'s instances (colocated ones: ``decode``)."""
        return self.prefill if role == "prefill" else self.decode

    def _scheduler(self, role: str) -> SchedulerConfig:
        """Scheduler sizes of ``role``: prefill's from ``prefill``, decode's from ``decode``
        (one token per request per step), colocated ones from both (chunking from
        ``prefill``, batch and KV size from ``decode``)."""
        block = self.kv_transfer.block_size
        if role == "prefill":
            p = self.prefill
            return SchedulerConfig(block, p.num_kv_blocks, p.chunk_size,
                                   p.max_num_batched_tokens, p.max_num_seqs)
        d = self.decode
        if role == "decode":
            return SchedulerConfig(block, d.num_kv_blocks, chunk_size=1,
                                   max_num_batched_tokens=d.max_num_seqs,
                                   max_num_seqs=d.max_num_seqs)
        return SchedulerConfig(block, d.num_kv_blocks, self.prefill.chunk_size,
                               self.prefill.max_num_batched_tokens, d.max_num_seqs)

    def _parallel(self, role: str) -> ParallelConfig:
        """The role's layout; ``dp_rank`` is set per instance by :meth:`instances`."""
        bind_host = self.cluster.bind_host or ("" if self.cluster.address else "127.0.0.1")
        section = self._section(role)
        cp = dict(cp=section.cp, layer_sharding=tuple(section.layer_sharding)) \
            if role == "prefill" else {}
        return ParallelConfig(tp=section.tp, dp=section.dp, ep=section.ep, **cp,
                              device=self.device(), dist_backend=self.dist_backend(),
                              bind_host=bind_host)


def _check_backend(backend: str, device: str) -> None:
    if backend == "auto" or device == "auto":
        return
    if DIST_BACKENDS[device] != backend:
        raise _cross_field(
            f"kv_transfer.backend '{backend}' does not work with cluster.device '{device}': "
            f"use backend '{DIST_BACKENDS[device]}' (or 'auto') for {device}")


def _check_graph_backend(graph: GraphSection, device: str) -> None:
    if graph.enabled and device not in GRAPH_BACKENDS.device_types(graph.backend or None):
        what = f"decode.graph.backend '{graph.backend}'" if graph.backend else \
            "graph mode (decode.graph.enabled)"
        usable = [n for n in GRAPH_BACKENDS.names() if device in GRAPH_BACKENDS.device_types(n)]
        raise _cross_field(
            f"{what} has no implementation on cluster.device '{device}': set "
            f"decode.graph.backend to one of {usable} (or leave it empty), or "
            "decode.graph.enabled false")


def _override(data: dict, key: str, value: object) -> None:
    """Set dotted ``key`` of the YAML mapping ``data`` to ``value`` (sections made as needed;
    a section that is not a mapping is left for validation to report)."""
    *sections, last = key.split(".")
    node = data
    for name in sections:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            return
    node[last] = value


def _resolve_config_json(data: dict, folder: Path) -> None:
    """Make a relative ``model.config_json`` relative to the YAML file's ``folder``."""
    model = data.get("model")
    value = model.get("config_json") if isinstance(model, dict) else None
    if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
        model["config_json"] = str(folder / value)


def load_config(path: str | Path, overrides: dict[str, object] | None = None) -> OrchConfig:
    """Read and validate a YAML config file, and each role's tp against the model
    (:func:`orchestrator.layout_check.check_tp_layout`, when the model's config is at hand).

    Args:
        path: the YAML file.
        overrides: dotted key path -> value (``{"router.port": 9000}``) replacing the file's
            values before validation (the `orch up --port` flags).

    Raises:
        ConfigError: the file is missing or unreadable, is not YAML, or does not validate, or
            a tp does not fit the model; the message names each offending key path, what is
            allowed and what to do.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}; check the path "
                          "(examples live in configs/)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_message(path, exc)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, mode, "
                          f"prefill, ...), got {type(data).__name__}; see docs/config.md")
    for key, value in (overrides or {}).items():
        _override(data, key, value)
    _resolve_config_json(data, path.resolve().parent)
    try:
        cfg = OrchConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_error_message(path, exc, OrchConfig)) from None
    from orchestrator.layout_check import check_tp_layout  # lazy: it imports this module

    try:
        check_tp_layout(cfg)
    except ConfigError as exc:
        raise ConfigError(f"invalid config {path}:\n- {exc}") from None
    return cfg

"""The `orch up` configuration: one frozen pydantic model per component, validated when loaded.

The YAML file maps one to one onto :class:`OrchConfig` (reference: docs/config.md).
:func:`load_config` turns every YAML or validation problem into one :class:`ConfigError` whose
message names the key path (``prefill.tp``), what is allowed and what to do.
:meth:`OrchConfig.instances` derives the per-instance :class:`prefill_worker.messages.InstanceConfig`
that the rank actors receive.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from prefill_worker.messages import InstanceConfig
from orchestrator.config_errors import ConfigError, validation_error_message, yaml_error_message

# NOTE: the only environment variable the control plane reads; see docs/config.md.
TINY_CACHE_ENV = "ORCH_CACHE_DIR"
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
DEVICE_FOR_BACKEND = {backend: device for device, backend in BACKEND_FOR_DEVICE.items()}


class _Section(BaseModel):
    # NOTE: strict: `tp: true` or `tp: "2"` are errors, not 1 and 2; no inf/nan durations.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def _cross_field(message: str) -> PydanticCustomError:
    return PydanticCustomError("cross_field", message)


class ModelSection(_Section):
    """Which checkpoint to serve and at what precision / context length."""

    path: str = Field("tiny", min_length=1)
    tiny_seed: int = Field(0, ge=0)
    tiny_dir: str = ""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_model_len: int = Field(2048, ge=2)

    @property
    def is_tiny(self) -> bool:
        return self.path == "tiny"

    def checkpoint_dir(self) -> Path:
        """The checkpoint folder; for ``tiny``, where the built-in tiny checkpoint lives.

        ``tiny`` resolves to ``tiny_dir`` when set, else ``$ORCH_CACHE_DIR/tiny-<seed>``, else
        ``~/.cache/orch/tiny-<seed>``. Nothing is created here (see ``checkpoint.py``).
        """
        if not self.is_tiny:
            return Path(self.path).expanduser()
        if self.tiny_dir:
            return Path(self.tiny_dir).expanduser()
        cache = os.environ.get(TINY_CACHE_ENV) or str(Path.home() / ".cache" / "orch")
        return Path(cache).expanduser() / f"tiny-{self.tiny_seed}"


class PrefillSection(_Section):
    """Prefill instances: ``dp`` instances of ``tp`` ranks, chunked prefill sizes."""

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    chunk_size: int = Field(512, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    num_kv_blocks: int = Field(256, ge=1)
    # Extra Ray resources every prefill rank's bundle asks for, to pin prefill to some nodes
    # (e.g. {"prefill_node": 0.01} with `ray start --resources '{"prefill_node": 1}'`).
    ray_resources: dict[str, float] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _chunk_fits_batch(self) -> "PrefillSection":
        if self.chunk_size > self.max_num_batched_tokens:
            raise _cross_field(
                f"prefill.chunk_size ({self.chunk_size}) must be <= "
                f"prefill.max_num_batched_tokens ({self.max_num_batched_tokens}): lower "
                "chunk_size or raise max_num_batched_tokens")
        return self


class DecodeSection(_Section):
    """Decode instances (and, in colocated mode, the colocated instances)."""

    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    num_kv_blocks: int = Field(256, ge=1)
    # Extra Ray resources every decode rank's bundle asks for (see PrefillSection).
    ray_resources: dict[str, float] = Field(default_factory=dict)


class KVTransferSection(_Section):
    """Data plane: dist backend, KV block size and the bounded waits of a transfer (seconds)."""

    backend: Literal["auto", "hccl", "nccl", "gloo"] = "auto"
    block_size: int = Field(16, gt=0)
    connect_timeout_s: float = Field(30.0, gt=0)
    header_timeout_s: float = Field(30.0, gt=0)
    payload_timeout_s: float = Field(60.0, gt=0)
    completion_timeout_s: float = Field(120.0, gt=0)


class RouterSection(_Section):
    """The gRPC front end."""

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535)
    policy: Literal["round_robin", "least_outstanding_tokens"] = "least_outstanding_tokens"
    max_pending: int = Field(64, ge=0)
    request_timeout_s: float = Field(120.0, gt=0)
    metrics_port: Optional[int] = Field(None, ge=0, le=65535)


class ClusterSection(_Section):
    """Where ranks run: Ray address ("" = embedded local Ray), device, CPUs per rank."""

    address: str = ""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    cpus_per_rank: float = Field(1.0, gt=0)
    startup_timeout_s: float = Field(600.0, gt=0)
    # Address the ranks' rendezvous stores (TP and KV pairs) listen on. "" = 127.0.0.1 with
    # the embedded Ray, else each node's IP as Ray reports it.
    bind_host: str = ""


class OrchConfig(_Section):
    """The whole deployment. Built by :func:`load_config`; frozen."""

    model: ModelSection = ModelSection()
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: PrefillSection = PrefillSection()
    decode: DecodeSection = DecodeSection()
    kv_transfer: KVTransferSection = KVTransferSection()
    router: RouterSection = RouterSection()
    cluster: ClusterSection = ClusterSection()

    @model_validator(mode="after")
    def _cross_section(self) -> "OrchConfig":
        _check_backend(self.kv_transfer.backend, self.cluster.device)
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
        return self

    def device(self) -> str:
        """The rank device: ``cluster.device``, or derived from the backend, or detected."""
        if self.cluster.device != "auto":
            return self.cluster.device
        if self.kv_transfer.backend != "auto":
            return DEVICE_FOR_BACKEND[self.kv_transfer.backend]
        return detect_device()

    def dist_backend(self) -> str:
        """torch.distributed backend for TP groups and KV pairs."""
        if self.kv_transfer.backend != "auto":
            return self.kv_transfer.backend
        return BACKEND_FOR_DEVICE[self.device()]

    def instances(self) -> list[InstanceConfig]:
        """One :class:`InstanceConfig` per instance: prefill-0.., decode-0.. or colocated-0.."""
        if self.mode == "colocated":
            return [self._instance("colocated", i, self.decode.tp, self.decode.num_kv_blocks)
                    for i in range(self.decode.dp)]
        prefill = [self._instance("prefill", i, self.prefill.tp, self.prefill.num_kv_blocks)
                   for i in range(self.prefill.dp)]
        decode = [self._instance("decode", i, self.decode.tp, self.decode.num_kv_blocks)
                  for i in range(self.decode.dp)]
        return prefill + decode

    def _instance(self, role: str, index: int, tp: int, num_kv_blocks: int) -> InstanceConfig:
        kv = self.kv_transfer
        return InstanceConfig(
            name=f"{role}-{index}", role=role, tp=tp,
            checkpoint_dir=str(self.model.checkpoint_dir()), dtype=self.model.dtype,
            max_model_len=self.model.max_model_len, block_size=kv.block_size,
            num_kv_blocks=num_kv_blocks, chunk_size=self.prefill.chunk_size,
            max_num_batched_tokens=self.prefill.max_num_batched_tokens,
            max_num_seqs=self.decode.max_num_seqs, device=self.device(),
            dist_backend=self.dist_backend(), connect_timeout_s=kv.connect_timeout_s,
            header_timeout_s=kv.header_timeout_s, payload_timeout_s=kv.payload_timeout_s,
            completion_timeout_s=kv.completion_timeout_s,
            bind_host=self.cluster.bind_host or ("" if self.cluster.address else "127.0.0.1"))


def _check_backend(backend: str, device: str) -> None:
    if backend == "auto" or device == "auto":
        return
    if BACKEND_FOR_DEVICE[device] != backend:
        raise _cross_field(
            f"kv_transfer.backend '{backend}' does not work with cluster.device '{device}': "
            f"use backend '{BACKEND_FOR_DEVICE[device]}' (or 'auto') for {device}")


def detect_device() -> str:
    """``npu`` when torch_npu imports and sees a device, else ``cuda`` when available, else cpu."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return "npu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_config(path: str | Path) -> OrchConfig:
    """Read and validate a YAML config file.

    Raises:
        ConfigError: the file is missing or unreadable, is not YAML, or does not validate; the
            message names each offending key path, what is allowed and what to do.
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
    try:
        return OrchConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_error_message(path, exc, OrchConfig)) from None

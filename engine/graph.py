"""Graph mode for decode: the decode forward captured once per batch-size bucket.

A decode-only step of B <= ``max(batch_sizes)`` sequences runs the captured forward of the
smallest bucket ``>= B``, padded with dummy 1-token sequences whose KV goes to the cache's
scratch block (never handed out by the block pool) and whose logits are dropped. Every other
step runs eager, which is also the reference (captured logits equal eager ones within 1e-5).
Backends come from a registry with lazy loaders: "compile" (cpu, inductor), "cudagraph" (cuda,
``reduce-overhead``) and "npugraph" (npu, torchair); the last two are untested here. NOTE: the
decode block table is ``[B, M]`` with M the longest sequence's blocks, so real CUDA graphs need
a fixed width. Paged decode attention is one opaque op (:func:`opaque_mla_decode`), so a new
context length never recompiles. A capture that raises turns that bucket eager with one
warning, kept in :attr:`DecodeGraphs.failures` (:meth:`DecodeGraphs.status` for a status
field; the runner's warmup logs one summary line at start-up); with ``required`` it raises
:class:`GraphCaptureError` instead (at start-up with ``warmup``). Otherwise a request never
fails because of graph mode. With speculative decoding the buckets count one-token rows
(:meth:`GraphConfig.in_tokens`) and the verify and MTP draft forwards are captured
(:mod:`engine.spec_forward`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.forward_context import DecodeBatch

log = logging.getLogger(__name__)

Capture = Callable[[Callable], Callable]
"""A capture backend: the forward -> a captured callable with the same signature."""
Loader = Callable[[], Capture]


@dataclass(frozen=True)
class GraphConfig:
    """Graph mode of one decode (or colocated) instance.

    Attributes:
        enabled: capture decode-only steps (False: every step eager, vLLM's enforce_eager).
        batch_sizes: the buckets, strictly increasing, each >= 1 (vLLM's cuda_graph_sizes).
        warmup: capture every bucket when the runner is built (else on first use).
        backend: a :data:`GRAPH_BACKENDS` name; None = the device type's default.
        required: a bucket whose capture fails is an error (:class:`GraphCaptureError`),
            not an eager fallback.

    Raises:
        ValueError: empty, non-increasing or non-positive ``batch_sizes``; unknown backend.
    """

    enabled: bool = False
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    warmup: bool = False
    backend: str | None = None
    required: bool = False

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or sizes[0] < 1 or any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"batch_sizes must be strictly increasing sizes >= 1, e.g. "
                             f"[1, 2, 4, 8], got {list(sizes)}")
        if self.backend is not None and self.backend not in GRAPH_BACKENDS.names():
            raise ValueError(f"backend {self.backend!r} is not one of "
                             f"{GRAPH_BACKENDS.names()}; leave it empty for the device's "
                             "default")

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket ``>= batch``, or None when ``batch`` exceeds every bucket."""
        return next((b for b in self.batch_sizes if b >= batch), None)

    def in_tokens(self, tokens_per_seq: int) -> GraphConfig:
        """This config with each bucket ``b`` as ``b * tokens_per_seq`` rows: a speculative
        step computes ``1 + k`` one-token rows per sequence, so its buckets count tokens
        (vLLM and SGLang capture speculative steps by token count too)."""
        return dataclasses.replace(
            self, batch_sizes=tuple(b * tokens_per_seq for b in self.batch_sizes))


class GraphCaptureError(RuntimeError):
    """A bucket could not be captured while graph mode is ``required``; the message names
    the bucket, the capture's error and what to change."""


class GraphBackendRegistry:
    """``name -> {device_type: loader}``, plus a default name per device type."""

    def __init__(self) -> None:
        self._loaders: dict[str, dict[str, Loader]] = {}
        self._defaults: dict[str, str] = {}

    def register(self, name: str, device_types: tuple[str, ...], loader: Loader, *,
                 default: bool = False) -> None:
        """Register ``loader`` as ``name`` on ``device_types`` (``default``: their default)."""
        table = self._loaders.setdefault(name, {})
        for device_type in device_types:
            table[device_type] = loader
            if default:
                self._defaults[device_type] = name

    def names(self) -> list[str]:
        return sorted(self._loaders)

    def device_types(self, name: str | None = None) -> list[str]:
        """Device types ``name`` has a loader for (None: those with a default backend);
        loads nothing."""
        table = self._defaults if name is None else self._loaders.get(name, {})
        return sorted(table)

    def get(self, device_type: str, name: str | None = None) -> Capture:
        """The capture function of ``name`` (or the device's default) on ``device_type``.

        Raises:
            KeyError: unknown name, or none registered for ``device_type``; the message
                lists what exists.
        """
        name = name or self._defaults.get(device_type)
        table = self._loaders.get(name or "", {})
        if device_type not in table:
            raise KeyError(f"no graph backend {name!r} for device {device_type!r}; registered: "
                           f"{ {n: sorted(t) for n, t in self._loaders.items()} }; set "
                           "decode.graph.backend to one of them or graph.enabled false")
        return table[device_type]()


def _load_compile() -> Capture:
    return lambda fn: torch.compile(fn, backend="inductor", dynamic=False)


def _load_cudagraph() -> Capture:
    return lambda fn: torch.compile(fn, mode="reduce-overhead", dynamic=False)


def _load_npugraph() -> Capture:
    import torchair  # noqa: PLC0415 (lazy: only on Ascend)

    config = torchair.CompilerConfig()
    config.mode = "reduce-overhead"
    backend = torchair.get_npu_backend(compiler_config=config)
    return lambda fn: torch.compile(fn, backend=backend, dynamic=False)


GRAPH_BACKENDS = GraphBackendRegistry()
"""The registry every runner resolves its capture backend from (filled here, at import)."""

GRAPH_BACKENDS.register("compile", ("cpu",), _load_compile, default=True)
GRAPH_BACKENDS.register("cudagraph", ("cuda",), _load_cudagraph, default=True)
GRAPH_BACKENDS.register("npugraph", ("npu",), _load_npugraph, default=True)


_OPAQUE_KERNELS: list[Callable] = []
"""mla_decode kernels wrapped by :func:`opaque_mla_decode`; the op names one by index."""


@torch.library.custom_op("orch::graph_mla_decode", mutates_args=())
def _mla_decode_op(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, batch: list[torch.Tensor], w_uk: torch.Tensor,
                   w_uv: torch.Tensor, scale: float, kernel: int) -> torch.Tensor:
    out = _OPAQUE_KERNELS[kernel](q_nope, q_pe, k_cache, v_cache, DecodeBatch(*batch), w_uk,
                                  w_uv, scale)
    return out.contiguous()  # NOTE: the fake below promises a fresh contiguous [B, H, V]


@_mla_decode_op.register_fake
def _mla_decode_fake(q_nope, q_pe, k_cache, v_cache, batch, w_uk, w_uv, scale, kernel):
    return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])


def opaque_mla_decode(kernel: Callable) -> Callable:
    """``kernel`` (the ``mla_decode`` contract of :mod:`engine.kernels`) as ONE opaque
    ``torch.library`` op of a captured graph; eager calls call ``kernel`` directly. NOTE:
    every field of :class:`engine.forward_context.DecodeBatch` must be a tensor (passed as a
    list, in field order)."""
    _OPAQUE_KERNELS.append(kernel)
    index = len(_OPAQUE_KERNELS) - 1

    def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                   w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        if not torch.compiler.is_compiling():  # NOTE: eager: no custom-op dispatch cost
            return kernel(q_nope, q_pe, k_cache, v_cache, batch, w_uk, w_uv, scale)
        fields = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
        return _mla_decode_op(q_nope, q_pe, k_cache, v_cache, fields, w_uk, w_uv, scale, index)

    return mla_decode


def mark_context_dynamic(batch: DecodeBatch | None) -> None:
    """Mark every dim of every tensor of ``batch`` dynamic for the capture (where it can be),
    so the compiled graph is not specialized on the context length; no-op for None."""
    if batch is None:
        return
    for f in dataclasses.fields(batch):
        tensor = getattr(batch, f.name)
        for dim in range(tensor.dim()):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


class DecodeGraphs:
    """The captured forwards of one runner, one per bucket, captured on first use; ``name``
    says which forward in logs and errors ("decode"; speculative: "verify", "draft").

    ``capture_s``: bucket -> seconds its first (capturing) call took; ``failures``: bucket
    -> why its capture failed (those run eager); ``failed``: the same buckets, as a set.
    Side effect: dynamo's process-wide ``recompile_limit`` is raised to at least
    ``len(batch_sizes) + 2``.

    Raises:
        KeyError: no backend for the device (from :meth:`GraphBackendRegistry.get`).
    """

    def __init__(self, forward: Callable, config: GraphConfig, device_type: str,
                 name: str = "decode") -> None:
        self.config, self.name = config, name
        self._forward = forward
        self._capture = GRAPH_BACKENDS.get(device_type, config.backend)
        # NOTE: every bucket compiles the same code objects once more; dynamo's per-code
        # recompile limit (8 by default, process-wide) must not silently turn later buckets
        # eager.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, len(config.batch_sizes) + 2)
        self._graphs: dict[int, Callable] = {}
        self.capture_s: dict[int, float] = {}
        self.failed: set[int] = set()
        self.failures: dict[int, str] = {}

    def status(self) -> dict:
        """``{"captured": [buckets], "eager": {bucket: reason}}`` (a status field)."""
        return {"captured": sorted(self.capture_s), "eager": dict(sorted(self.failures.items()))}

    def describe(self) -> str:
        """:meth:`status` as one line: "captured [1, 2]; eager 4 (RuntimeError: ...)" (buckets
        never run yet are in neither)."""
        status = self.status()
        eager = "; ".join(f"eager {b} ({why})" for b, why in status["eager"].items())
        return "; ".join(p for p in (f"captured {status['captured']}", eager) if p)

    def bucket_for(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> int | None:
        """The bucket of a step, or None when it must run eager (not decode-only, more
        sequences than the largest bucket, or its bucket's capture failed)."""
        decode_only = all(q == 1 and c > 0 for q, c in zip(query_lens, context_lens))
        bucket = self.config.bucket(len(query_lens)) if decode_only else None
        return None if bucket in self.failed else bucket

    def run(self, bucket: int, *args: object) -> torch.Tensor | None:
        """The captured forward of ``bucket`` on ``args`` (inputs padded to ``bucket`` rows),
        capturing it first if needed; None when the bucket runs eager (its capture failed:
        the caller runs the eager forward)."""
        if bucket in self.failed:
            return None
        first = bucket not in self._graphs
        start = time.perf_counter()
        try:
            if first:
                self._graphs[bucket] = self._capture(self._forward)
            out = self._graphs[bucket](*args)
        except Exception as exc:  # noqa: BLE001 (any capture error: that bucket runs eager)
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self.config.required:
                raise GraphCaptureError(
                    f"graph mode is required but {self.name} bucket {bucket} cannot be captured "
                    f"({reason}); fix the capture, drop the bucket from "
                    "decode.graph.batch_sizes, or set decode.graph.required false to run it "
                    "eager") from exc
            self.failed.add(bucket)
            self.failures[bucket] = reason
            log.warning("graph mode: %s bucket %d falls back to eager, its capture failed: %s",
                        self.name, bucket, reason)
            return None
        if first:
            self.capture_s[bucket] = time.perf_counter() - start
            log.info("graph mode: captured %s bucket %d in %.2f s", self.name, bucket,
                     self.capture_s[bucket])
        return out

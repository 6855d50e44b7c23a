"""Graph mode for prefill: prefill-only steps run one forward compiled for any token count.

A step whose every sequence is a prefill (no decode row) of two or more tokens in all runs
the model's layers as ONE compiled graph with a dynamic token count T (``torch.compile``,
``dynamic=True``), compiled once, at start-up with ``warmup``. The logits stay outside it
(the eager lm_head over the last row of each sequence), so the graph never depends on how
many sequences a step holds. Attention over the prefill sequences is one opaque
``torch.library`` op (:func:`mla_prefill`) whose rows and cached prefixes travel as one
packed int64 tensor (:func:`pack_prefills`): a new count of sequences, chunk length or prefix
length never recompiles. This is vLLM's design for prefill (the whole model compiled with a
symbolic token count, attention as the op the graph splits at; vLLM's
``compilation_config``), in the capture backends of :mod:`engine.graph`'s registry style.

Every other step runs eager, which is also the reference (the graph's logits equal eager ones
within 1e-5, tests/engine/test_prefill_graph.py): decode rows, a one-token step (dynamic
shapes specialize sizes 0 and 1), a step that sends KV layer by layer (``on_kv_written``: a
callback per layer cannot sit in a graph), context parallel, DSA sparse attention and
speculative decoding. A capture that raises turns prefill graph mode off for the runner with
one warning (kept in :attr:`PrefillGraph.failure`), or raises :class:`GraphCaptureError`
with ``required``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from engine.graph import GraphBackendRegistry, GraphCaptureError
from engine.prefill_seq import PrefillSeq

log = logging.getLogger(__name__)

MIN_TOKENS = 2
"""Fewest tokens a step needs to run the graph: sizes 0 and 1 are specialized by dynamic
shapes, so a one-token step would compile a second graph."""


@dataclass(frozen=True)
class PrefillGraphConfig:
    """Graph mode of one prefill (or colocated) instance's prefill-only steps.

    Attributes:
        enabled: compile them (False: every prefill step eager).
        warmup: compile when the runner is built (else on the first prefill-only step, which
            then waits for the compile: 10-20 s on a CPU).
        backend: a :data:`PREFILL_GRAPH_BACKENDS` name; None = the device type's default.
        required: a failed capture is an error (:class:`GraphCaptureError`), not eager.

    Raises:
        ValueError: an unknown backend.
    """

    enabled: bool = False
    warmup: bool = True
    backend: str | None = None
    required: bool = False

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in PREFILL_GRAPH_BACKENDS.names():
            raise ValueError(f"backend {self.backend!r} is not one of "
                             f"{PREFILL_GRAPH_BACKENDS.names()}; leave it empty for the "
                             "device's default")


def check_prefill_graph(config, cp: int, ep: int, num_speculative_tokens: int) -> None:
    """Refuse prefill graph mode where it has no capture (module docstring).

    Args:
        config: the model's :class:`engine.model_config.ModelConfig`.
        cp, ep: the runner's context- and expert-parallel sizes.
        num_speculative_tokens: MTP drafts per step (0: off).

    Raises:
        ValueError: cp > 1, ep > 1, speculative decoding or DSA sparse attention, naming
            each and the setting to change.
    """
    why = [what for what, bad in (
        ("context parallel (prefill.cp > 1)", cp > 1),
        ("expert parallel (ep)", ep > 1),
        ("speculative decoding (num_speculative_tokens > 0)", num_speculative_tokens > 0),
        ("DSA sparse attention (DeepSeek-V3.2, GLM-5)", config.uses_sparse_attention))
        if bad]
    if why:
        raise ValueError(f"prefill graph mode does not run with {', '.join(why)}: set "
                         "prefill.graph.enabled false")


def _load_dynamic_compile():
    return lambda fn: torch.compile(fn, backend="inductor", dynamic=True)


PREFILL_GRAPH_BACKENDS = GraphBackendRegistry()
"""Capture backends of the prefill graph. NOTE: CUDA graphs and NPU graphs record fixed
shapes (vLLM captures prefill piecewise per token-count size); only inductor's dynamic-shape
compile is registered, on cpu and cuda."""

PREFILL_GRAPH_BACKENDS.register("compile", ("cpu", "cuda"), _load_dynamic_compile,
                                default=True)


def pack_prefills(prefills: Sequence[PrefillSeq]) -> torch.Tensor:
    """The prefill sequences of a step as one CPU int64 tensor
    ``[1 + 2B + (B + 1) + P]``: B; then ``start, end`` of each sequence's rows; then the
    offsets of each sequence's prefix slots in the tail (``B + 1``, from 0); then the prefix
    slots of all sequences (P in all). Its length is at least 5 (B >= 1): never a size that
    dynamic shapes specialize. Inverse: :func:`unpack_prefills`."""
    bounds = [x for seq in prefills for x in (seq.start, seq.end)]
    lens = [seq.prefix_slots.numel() for seq in prefills]
    offsets = [0]
    for n in lens:
        offsets.append(offsets[-1] + n)
    head = torch.tensor([len(prefills), *bounds, *offsets], dtype=torch.int64)
    slots = [seq.prefix_slots.to("cpu", torch.int64) for seq, n in zip(prefills, lens) if n]
    return torch.cat([head, *slots]) if slots else head


def unpack_prefills(pack: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, end, prefix_slots [n] int64)`` of each sequence of a
    :func:`pack_prefills` tensor."""
    values = pack.tolist()
    b = values[0]
    bounds, offsets = values[1:1 + 2 * b], values[1 + 2 * b:2 + 3 * b]
    tail = pack[2 + 3 * b:]
    return [(bounds[2 * i], bounds[2 * i + 1], tail[offsets[i]:offsets[i + 1]])
            for i in range(b)]


_LAYERS: dict[int, weakref.ref] = {}
"""Attention modules the op can name (:func:`register_prefill_layer`), by key."""


def register_prefill_layer(layer: object) -> int:
    """A key naming ``layer`` (an :class:`engine.attention.MLAttention`) in the op; the
    entry goes when the layer is collected."""
    key = id(layer)
    _LAYERS[key] = weakref.ref(layer, lambda _ref, key=key: _LAYERS.pop(key, None))
    return key


@torch.library.custom_op("orch::graph_mla_prefill", mutates_args=())
def _mla_prefill_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, pack: torch.Tensor, layer: int) -> torch.Tensor:
    out = torch.empty_like(v)
    _LAYERS[layer]().prefill_rows(out, q, k, v, unpack_prefills(pack), k_cache, v_cache)
    return out


@_mla_prefill_op.register_fake
def _mla_prefill_fake(q, k, v, k_cache, v_cache, pack, layer):
    return torch.empty_like(v)


def mla_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, pack: torch.Tensor, layer: int) -> torch.Tensor:
    """The prefill attention of a step as one opaque op: ``[T, H, V]`` output of queries
    ``q [T, H, P+R]`` over their own keys ``k [T, H, P+R]`` and values ``v [T, H, V]``
    (causal within each sequence of ``pack``, :func:`pack_prefills`) and the cached
    prefixes in ``pack`` read from ``k_cache`` / ``v_cache`` (``[num_blocks, block_size,
    L / R]``), by the layer registered as ``layer``
    (:meth:`engine.attention.MLAttention.prefill_rows`, the eager maths)."""
    return _mla_prefill_op(q, k, v, k_cache, v_cache, pack, layer)


def mark_prefill_dynamic(*tensors: torch.Tensor) -> None:
    """Mark dim 0 of each of ``tensors`` dynamic for the capture."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


class PrefillGraph:
    """The compiled prefill-only forward of one runner.

    Args:
        model: the runner's :class:`engine.model.DeepseekForCausalLM` (its layers and final
            norm are compiled, ``forward(..., return_hidden=True)``; its lm_head runs eager).
        kv_cache: the runner's KV cache.
        config: the instance's prefill graph config.
        device_type: "cpu", "cuda", ...

    Attributes:
        capture_s: seconds the capturing call took (None until captured).
        failure: why the capture failed (None: it did not); then every step runs eager.

    Raises:
        KeyError: no backend for the device (from :meth:`GraphBackendRegistry.get`).
    """

    def __init__(self, model, kv_cache, config: PrefillGraphConfig, device_type: str) -> None:
        self.config, self._model, self._kv_cache = config, model, kv_cache
        self._capture = PREFILL_GRAPH_BACKENDS.get(device_type, config.backend)
        self._graph: Callable | None = None
        self.capture_s: float | None = None
        self.failure: str | None = None

    def step(self, input_ids: torch.Tensor, meta) -> torch.Tensor | None:
        """``[B, vocab]`` logits of a prefill-only step (``input_ids [T]``, its
        :class:`engine.forward_context.AttentionMetadata`) from the compiled layers and the
        eager lm_head, or None when it runs eager (the capture failed).

        Raises:
            GraphCaptureError: the capture failed with ``required``.
        """
        graph_meta = replace(meta, prefills=(), prefill_pack=pack_prefills(meta.prefills))
        mark_prefill_dynamic(input_ids, graph_meta.positions, graph_meta.slot_mapping,
                             graph_meta.prefill_pack)
        hidden = self.run(input_ids, graph_meta, self._kv_cache)
        return None if hidden is None else self._model.compute_logits(hidden[meta.logits_index])

    def _trunk(self, input_ids: torch.Tensor, meta, kv_cache) -> torch.Tensor:
        """What is compiled: ``[T, hidden]`` normed hidden states."""
        return self._model(input_ids, meta, kv_cache, return_hidden=True)

    @staticmethod
    def takes(query_lens: Sequence[int], context_lens: Sequence[int]) -> bool:
        """Whether a step of these sequences is prefill-only (no one-token row after a cached
        context, which is decode) with at least :data:`MIN_TOKENS` tokens."""
        return sum(query_lens) >= MIN_TOKENS and not any(
            q == 1 and c > 0 for q, c in zip(query_lens, context_lens))

    def status(self) -> dict:
        """``{"captured": bool, "eager": reason or None}`` (a status field)."""
        return {"captured": self.capture_s is not None, "eager": self.failure}

    def describe(self) -> str:
        """:meth:`status` as one line: "captured", "eager (reason)" or "not captured yet"."""
        if self.failure is not None:
            return f"eager ({self.failure})"
        return "captured" if self.capture_s is not None else "not captured yet"

    def run(self, *args: object) -> torch.Tensor | None:
        """The compiled trunk on ``args``, capturing it first if needed; None when it runs
        eager (its capture failed: the caller runs the eager forward).

        Raises:
            GraphCaptureError: the capture failed with ``required``.
        """
        if self.failure is not None:
            return None
        first = self._graph is None
        start = time.perf_counter()
        try:
            if first:
                self._graph = self._capture(self._trunk)
            out = self._graph(*args)
        except Exception as exc:  # noqa: BLE001 (any capture error: prefill runs eager)
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self.config.required:
                raise GraphCaptureError(
                    f"prefill graph mode is required but the prefill forward cannot be "
                    f"captured ({reason}); fix the capture, or set prefill.graph.required "
                    "false to run it eager") from exc
            self.failure = reason
            log.warning("prefill graph mode: the capture failed, prefill runs eager: %s",
                        reason)
            return None
        if first:
            self.capture_s = time.perf_counter() - start
            log.info("prefill graph mode: captured in %.2f s", self.capture_s)
        return out

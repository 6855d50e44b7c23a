"""The lm_head GEMM (``hidden [R, H] -> logits [R, V]``), prepared once per weight.

The ``lm_head`` kernel (:mod:`engine.kernels`) is a factory: ``lm_head(weight [V, H]) ->
gemm`` where ``gemm(hidden [R, H]) -> [R, V]`` equals ``F.linear(hidden, weight)``. The
runner builds it after the weights are loaded (:meth:`engine.model.DeepseekForCausalLM.
prepare_lm_head`), so a variant may lay the weight out for its GEMM once, as vLLM's CPU
backend does for its linears (``dispatch_cpu_unquantized_gemm``: a oneDNN matmul over a
prepacked weight).

Why on CPU: the vocabulary GEMM is most of a small model's decode step, and torch's
``F.linear`` (MKL sgemm over the ``[H, V]`` storage, :func:`engine.model.build_model`)
slows with the rows: at ``[8, 64] x [64, 129280]`` fp32, one thread, it took 5.5 ms against
3.6 ms for oneDNN over a weight reordered for it (2.5 vs 2.9 ms at one row, where the plain
GEMM wins; docs/performance.md "The lm_head GEMM").

Graph mode: inside a capture the packed GEMM is ONE opaque ``torch.library`` op,
``orch::onednn_lm_head`` (inductor cannot lower ``mkldnn._linear_pointwise`` over a weight
packed outside the graph), so a captured decode step runs the same GEMM as an eager one.
``torch_lm_head`` (CUDA / NPU) stays ``F.linear`` and is traced as such.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from itertools import count

import torch
import torch.nn.functional as F

LogitsGemm = Callable[[torch.Tensor], torch.Tensor]

PACKED_MIN_ROWS = 2
"""Rows from which the oneDNN variant uses its packed weight (one row: the plain GEMM)."""


_PACKED: dict[int, torch.Tensor] = {}
"""Packed weights of the live :func:`onednn_lm_head` GEMMs, by key (the op names one by
key: an mkldnn tensor cannot be an input of a traced graph); a GEMM's entry goes with it."""
_KEYS = count()


@torch.library.custom_op("orch::onednn_lm_head", mutates_args=())
def _onednn_lm_head_op(hidden: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    """``hidden [R, H] -> [R, V]`` through the packed copy ``_PACKED[key]`` of ``weight
    [V, H]`` (the weight itself is an input for the shapes only)."""
    return _packed_gemm(hidden, _PACKED[key])


@_onednn_lm_head_op.register_fake
def _onednn_lm_head_fake(hidden, weight, key):
    return hidden.new_empty(hidden.shape[0], weight.shape[0])


def _packed_gemm(hidden: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), packed, None, "none", [], "")


def torch_lm_head(weight: torch.Tensor) -> LogitsGemm:
    """``F.linear`` over ``weight [V, H]`` as stored (every device)."""
    return lambda hidden: F.linear(hidden, weight)


def onednn_lm_head(weight: torch.Tensor) -> LogitsGemm:
    """CPU: oneDNN's matmul over a copy of ``weight [V, H]`` reordered for it
    (``torch.ops.mkldnn._reorder_linear_weight``, the op torch's own CPU compiler packs
    linears with) for ``PACKED_MIN_ROWS`` rows or more, ``F.linear`` below that; the plain
    GEMM when torch has no oneDNN or the weight is not fp32 (the only dtype measured).

    NOTE: the packed copy is a second ``V x H`` weight (the plain one stays: one-row steps,
    and a tied lm_head is the embedding); it is taken when this is called, so the weight
    must be loaded and never change afterwards. Inside a capture (``torch.compile``) the
    packed GEMM is the opaque op ``orch::onednn_lm_head``; a one-row bucket traces
    ``F.linear`` as eager runs it.
    """
    plain = torch_lm_head(weight)
    if not torch.backends.mkldnn.is_available() or weight.dtype != torch.float32:
        return plain
    # NOTE: the hint is the batch the reorder is tuned for: 4 to 64 ran alike at 2-16 rows,
    # 1 was as slow as the plain GEMM there
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 8)
    key = next(_KEYS)

    def gemm(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] < PACKED_MIN_ROWS:
            return plain(hidden)
        if torch.compiler.is_compiling():  # NOTE: eager: no custom-op dispatch cost
            return _onednn_lm_head_op(hidden, weight, key)
        return _packed_gemm(hidden, packed)

    _PACKED[key] = packed
    weakref.finalize(gemm, _PACKED.pop, key, None)
    return gemm

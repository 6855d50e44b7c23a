"""W8A8 dynamic int8: per-channel int8 weights, per-token int8 activations quantized at run time.

``y = (x_q @ W_q^T) * x_scale * w_scale`` with ``x_scale [T, 1] = max|x| / 127`` per token
and ``w_scale [out, 1]`` per output channel (symmetric, no zero points). The int8 GEMM
accumulates in int32 (exact); everything after it is float32, cast to the caller's dtype last.

Kernels (resolved through :mod:`engine.kernels`; these are the torch references, CPU/CUDA):

- :func:`w8a8_linear`: one int8 linear layer.
- :func:`w8a8_mlp`: the fused expert MLP: gate/up int8 GEMM -> dequant -> SwiGLU ->
  per-token quant -> down int8 GEMM -> dequant (:func:`dequant_swiglu_quant` is the fused
  middle step; on Ascend one ``npu_dequant_swiglu_quant`` call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT8_MAX = 127.0


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, K]`` -> ``(int8 [T, K], float32 scale [T, 1])``, scale = max|x_t| / 127.

    A token of zeros gets scale 1 (its values quantize to 0 either way).
    """
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return (x / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight ``[out, in]`` -> ``(int8 [out, in], float32 scale [out, 1])`` (symmetric)."""
    return quantize_per_token(w)


EXACT_FP32_K = 1024
"""K chunk whose int8 dot products sum exactly in float32: 1024 * 128 * 127 < 2^24."""


def int8_gemm(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """``x_q [T, K] int8 @ w_q [N, K]^T`` -> int32 ``[T, N]`` (exact).

    Float32 GEMMs over K chunks of :data:`EXACT_FP32_K`, each exact (every partial sum is an
    integer below 2^24; int8 inputs are exact in TF32 too), summed in int32. NOTE: bit-equal
    to ``torch._int_mm`` and 2-15x faster on CPUs without AVX512-VNNI, where PyTorch's int8
    GEMM has no fast path (docs/quantization.md); ``torch._int_mm`` is not used on CUDA
    either (untested here, and it refuses T <= 16 rows in some versions).
    """
    acc = None
    for k in range(0, x_q.shape[1], EXACT_FP32_K):
        part = torch.mm(x_q[:, k:k + EXACT_FP32_K].float(),
                        w_q[:, k:k + EXACT_FP32_K].float().t()).to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` (float) -> ``[T, N]`` in ``x``'s dtype.

    Args:
        weight: int8 ``[N, K]``. weight_scale: float32 ``[N, 1]``.
    """
    x_q, x_scale = quantize_per_token(x)
    acc = int8_gemm(x_q, weight)  # [T, N] int32
    return (acc.float() * x_scale * weight_scale.t()).to(x.dtype)


def dequant_swiglu_quant(acc: torch.Tensor, x_scale: torch.Tensor,
                         gate_up_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused middle of the expert MLP.

    Args:
        acc: int32 ``[T, 2I]`` gate/up GEMM output (gate columns first).
        x_scale: ``[T, 1]`` the input's per-token scales. gate_up_scale: ``[2I, 1]``.

    Returns:
        ``(int8 [T, I], float32 scale [T, 1])``: ``silu(gate) * up``, quantized per token.
    """
    h = acc.float() * x_scale * gate_up_scale.t()  # [T, 2I]
    gate, up = h.chunk(2, dim=-1)
    return quantize_per_token(F.silu(gate) * up)


def w8a8_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_scale: torch.Tensor,
             down_weight: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP in int8: ``x [T, H]`` -> ``[T, H]`` in ``x``'s dtype.

    Args:
        gate_up_weight: int8 ``[2I, H]`` (gate rows, then up rows); gate_up_scale ``[2I, 1]``.
        down_weight: int8 ``[H, I]``; down_scale ``[H, 1]``.
    """
    x_q, x_scale = quantize_per_token(x)
    a_q, a_scale = dequant_swiglu_quant(int8_gemm(x_q, gate_up_weight), x_scale, gate_up_scale)
    acc = int8_gemm(a_q, down_weight)  # [T, H] int32
    return (acc.float() * a_scale * down_scale.t()).to(x.dtype)

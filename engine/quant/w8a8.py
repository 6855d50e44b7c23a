"""W8A8 dynamic int8: per-channel int8 weights, per-token int8 activations quantized at run time.

``y = (x_q @ W_q^T) * x_scale * w_scale`` with ``x_scale [T, 1] = max|x| / 127`` per token and
``w_scale [out, 1]`` per output channel (symmetric, no zero points); the int8 GEMM is exact in
int32, the rest float32, cast to the caller's dtype last. These are the torch reference kernels
(:mod:`engine.kernels`): :func:`w8a8_linear` and the fused expert :func:`w8a8_mlp`, whose
middle :func:`dequant_swiglu_quant` is one ``npu_dequant_swiglu_quant`` call on Ascend.
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

    Float32 GEMMs over K chunks of :data:`EXACT_FP32_K` (each exact: partial sums are integers
    below 2^24), summed in int32. NOTE: bit-equal to ``torch._int_mm``, 2-15x faster on CPUs
    without AVX512-VNNI (docs/quantization.md).
    """
    acc = None
    for k in range(0, x_q.shape[1], EXACT_FP32_K):
        part = torch.mm(x_q[:, k:k + EXACT_FP32_K].float(),
                        w_q[:, k:k + EXACT_FP32_K].float().t()).to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """``x [T, K]`` (float), int8 ``weight [N, K]``, fp32 ``weight_scale [N, 1]`` ->
    ``[T, N]`` in ``x``'s dtype."""
    x_q, x_scale = quantize_per_token(x)
    acc = int8_gemm(x_q, weight)  # [T, N] int32
    return (acc.float() * x_scale * weight_scale.t()).to(x.dtype)


def dequant_swiglu_quant(acc: torch.Tensor, x_scale: torch.Tensor,
                         gate_up_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Int32 gate/up GEMM output ``acc [T, 2I]`` (gate first), ``x_scale [T, 1]``,
    ``gate_up_scale [2I, 1]`` -> ``silu(gate) * up`` quantized per token:
    ``(int8 [T, I], float32 scale [T, 1])``."""
    h = acc.float() * x_scale * gate_up_scale.t()  # [T, 2I]
    gate, up = h.chunk(2, dim=-1)
    return quantize_per_token(F.silu(gate) * up)


def w8a8_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, gate_up_scale: torch.Tensor,
             down_weight: torch.Tensor, down_scale: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP in int8: ``x [T, H]`` -> ``[T, H]`` in ``x``'s dtype; int8
    ``gate_up_weight [2I, H]`` (gate rows first), ``gate_up_scale [2I, 1]``, int8
    ``down_weight [H, I]``, ``down_scale [H, 1]``."""
    x_q, x_scale = quantize_per_token(x)
    a_q, a_scale = dequant_swiglu_quant(int8_gemm(x_q, gate_up_weight), x_scale, gate_up_scale)
    acc = int8_gemm(a_q, down_weight)  # [T, H] int32
    return (acc.float() * a_scale * down_scale.t()).to(x.dtype)

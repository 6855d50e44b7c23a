"""Ascend implementations of the W8A8 kernels (torch_npu fused ops; UNTESTED off-Ascend).

vLLM-Ascend's W8A8-dynamic path (``w8a8_dynamic.py``): ``npu_dynamic_quant`` (per-token int8),
``npu_quant_matmul`` (int8 GEMM with dequant) and ``npu_dequant_swiglu_quant``. Weights are
passed ``[N, K]`` like the torch reference and transposed here (a view).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def load_w8a8_linear() -> Callable:
    """``w8a8_linear`` on NPU (lazy ``torch_npu`` import)."""
    import torch_npu  # noqa: PLC0415 (lazy: only on Ascend)

    def w8a8_linear_npu(x: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = torch_npu.npu_dynamic_quant(x)  # int8 [T, K], [T]
        return torch_npu.npu_quant_matmul(x_q, weight.t(), weight_scale.view(-1),
                                          pertoken_scale=x_scale, output_dtype=x.dtype)

    return w8a8_linear_npu


def load_w8a8_mlp() -> Callable:
    """``w8a8_mlp`` on NPU: int32 gate/up GEMM, fused dequant-SwiGLU-quant, dequant down GEMM."""
    import torch_npu  # noqa: PLC0415 (lazy: only on Ascend)

    def w8a8_mlp_npu(x: torch.Tensor, gate_up_weight: torch.Tensor,
                     gate_up_scale: torch.Tensor, down_weight: torch.Tensor,
                     down_scale: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = torch_npu.npu_dynamic_quant(x)
        acc = torch_npu.npu_quant_matmul(x_q, gate_up_weight.t(),
                                         torch.ones_like(gate_up_scale.view(-1)),
                                         output_dtype=torch.int32)  # [T, 2I]
        a_q, a_scale = torch_npu.npu_dequant_swiglu_quant(
            acc, weight_scale=gate_up_scale.view(-1), activation_scale=x_scale,
            activate_left=True, quant_mode=1)
        return torch_npu.npu_quant_matmul(a_q, down_weight.t(), down_scale.view(-1),
                                          pertoken_scale=a_scale, output_dtype=x.dtype)

    return w8a8_mlp_npu

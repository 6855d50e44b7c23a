"""FP8 block and W8A8 int8 kernels against plain references (shapes with partial blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels import KERNELS
from engine.quant import w8a8
from engine.quant.fp8_block import FP8_MAX, block_grid, dequantize_block, quantize_block


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_fp8_block_scales_are_per_block_with_partial_last_blocks():
    w = _randn(200, 300)
    w[130:, :128] *= 100  # block (1, 0) has a much larger range
    q, scale_inv = quantize_block(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == block_grid(200, 300, (128, 128))
    assert scale_inv.shape == (2, 3)
    torch.testing.assert_close(scale_inv[1, 0], w[128:, :128].abs().max() / FP8_MAX)
    back = dequantize_block(q, scale_inv, (128, 128))
    scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 (scaled units)
    assert ((back - w).abs() <= w.abs() / 16 + scale * 2**-9).all()


def test_fp8_dequantize_of_a_part_equals_the_part_of_the_whole():
    w = _randn(200, 300, seed=1)
    q, scale_inv = quantize_block(w, (128, 128))
    whole = dequantize_block(q, scale_inv, (128, 128))
    part = dequantize_block(q[100:200, 150:300], scale_inv[0:2, 1:3], (128, 128), (100, 22))
    assert torch.equal(part, whole[100:200, 150:300])


def test_int8_linear_is_close_to_float_linear():
    x, w = _randn(7, 96, seed=2), _randn(40, 96, seed=3)
    w_q, w_scale = w8a8.quantize_per_channel(w)
    y = w8a8.w8a8_linear(x, w_q, w_scale)
    ref = x @ w.t()
    assert y.dtype == x.dtype
    assert F.cosine_similarity(y.flatten(), ref.flatten(), dim=0) > 0.999


def _unfused_mlp(x, gate, up, down):
    """Three int8 linears with a float SwiGLU between: the reference of the fused kernel."""
    h = F.silu(w8a8.w8a8_linear(x, *gate)) * w8a8.w8a8_linear(x, *up)
    return h, w8a8.w8a8_linear(h, *down)


def test_fused_expert_mlp_equals_unfused_reference_bit_for_bit():
    x = _randn(11, 64, seed=4)
    gate, up = (w8a8.quantize_per_channel(_randn(32, 64, seed=s)) for s in (5, 6))
    down = w8a8.quantize_per_channel(_randn(64, 32, seed=7))
    gate_up_w, gate_up_s = torch.cat((gate[0], up[0])), torch.cat((gate[1], up[1]))
    mlp = KERNELS.get("w8a8_mlp", "cpu")
    out = mlp(x, gate_up_w, gate_up_s, *down)
    h_ref, out_ref = _unfused_mlp(x, gate, up, down)
    # the int8 activation the fused middle step hands to the down GEMM
    x_q, x_scale = w8a8.quantize_per_token(x)
    a_q, a_scale = w8a8.dequant_swiglu_quant(w8a8.int8_gemm(x_q, gate_up_w), x_scale, gate_up_s)
    h_q, h_scale = w8a8.quantize_per_token(h_ref)
    assert a_q.dtype == torch.int8 and torch.equal(a_q, h_q) and torch.equal(a_scale, h_scale)
    assert torch.equal(out, out_ref)


def test_zero_tokens_quantize_to_zero_with_scale_one():
    q, scale = w8a8.quantize_per_token(torch.zeros(2, 8))
    assert torch.equal(q, torch.zeros(2, 8, dtype=torch.int8))
    assert torch.equal(scale, torch.ones(2, 1))


def test_cpu_int8_gemm_is_exact_at_the_extremes():
    """Every product at +-128 * 127 and K = 7168 (7 float32 chunks): equal to torch._int_mm."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randint(-127, 128, (5, 7168), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (24, 7168), dtype=torch.int8, generator=gen)
    x[0], w[0], w[1] = 127, -128, 127  # the largest sums: -127*128*7168, 127*127*7168
    w[2] = torch.randint(64, 128, (7168,), dtype=torch.int8, generator=gen)  # odd sum > 2^26
    assert torch.equal(w8a8.int8_gemm(x, w), torch._int_mm(x, w.t()))

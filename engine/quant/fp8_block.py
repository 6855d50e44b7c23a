"""DeepSeek FP8 block quantization: float8_e4m3fn weights with one float32 scale per block.

A weight ``W [out, in]`` is stored as ``Q [out, in]`` (e4m3) and ``scale_inv [ceil(out/bo),
ceil(in/bi)]`` (``(bo, bi)`` = ``weight_block_size``, 128 x 128 in DeepSeek's checkpoints);
``W[r, c] = Q[r, c] * scale_inv[r // bo, c // bi]``. The last block of a dim is partial when
the dim is not a multiple of the block (ceil division, as DeepSeek's ``weight_dequant``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def block_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """Shape of the scale grid of a ``[rows, cols]`` weight: ``(ceil(rows/bo), ceil(cols/bi))``."""
    return -(-rows // block[0]), -(-cols // block[1])


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Float32 ``[r, c]`` weight from ``q [r, c]`` (any dtype; a part starting at row/col
    ``offset`` of the full weight) and ``scale_inv``, the FULL weight's grid
    ``[ceil(out/bo), ceil(in/bi)]`` (or the part whose first block is ``offset // block``,
    with ``offset % block`` passed); ``block`` = (bo, bi)."""
    rows = (torch.arange(q.shape[0], device=q.device) + offset[0]) // block[0]
    cols = (torch.arange(q.shape[1], device=q.device) + offset[1]) // block[1]
    return q.float() * scale_inv.float()[rows][:, cols]


def quantize_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [out, in], scale_inv float32 grid)`` with ``scale = amax / 448``.

    An all-zero block gets scale 1 (its values are 0 either way).
    """
    out, inp = w.shape
    grid = block_grid(out, inp, block)
    padded = w.float().new_zeros(grid[0] * block[0], grid[1] * block[1])
    padded[:out, :inp] = w.float()
    tiles = padded.view(grid[0], block[0], grid[1], block[1])
    amax = tiles.abs().amax(dim=(1, 3))  # [G0, G1]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[:, None, :, None]).view_as(padded)[:out, :inp]
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), scale_inv


class Fp8BlockLinear(nn.Module):
    """Linear layer that keeps the FP8 weight and dequantizes it per block at use.

    Buffers (checkpoint names): ``weight`` float8_e4m3fn ``[out, in]`` and ``weight_scale_inv``
    float32 ``[ceil(out/bo), ceil(in/bi)]``. Under TP the local weight must start on a block
    boundary of the full weight (checked by the loader), so its grid is the local part of the
    checkpoint's.
    """

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int]) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.register_buffer("weight", torch.empty(out_features, in_features,
                                                   dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.empty(
            block_grid(out_features, in_features, block), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out]`` in ``x``'s dtype."""
        w = dequantize_block(self.weight, self.weight_scale_inv, self.block)
        return F.linear(x, w.to(x.dtype))

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` dequantized (float32 maths) and cast to ``dtype``, what
        :meth:`forward` multiplies by (for callers that use the matrix itself, e.g.
        DeepSeek-V4's grouped ``o_a_proj``)."""
        return dequantize_block(self.weight, self.weight_scale_inv, self.block).to(dtype)


def dense_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``[out, in]`` matrix of an ``nn.Linear`` (its weight) or an :class:`Fp8BlockLinear`
    (dequantized, :meth:`Fp8BlockLinear.dense`), in ``dtype``."""
    if isinstance(linear, Fp8BlockLinear):
        return linear.dense(dtype)
    return linear.weight.to(dtype)


class Fp8BlockExperts(nn.Module):
    """A stack of ``E`` FP8 block-quantized expert weights, e.g. DeepSeek-V4's fused
    ``experts.gate_up_proj [E, 2I, hidden]``: ``experts[e]`` is expert ``e``'s float32
    ``[out, in]`` (dequantized at use, as :class:`Fp8BlockLinear`).

    Buffers: ``weight`` float8_e4m3fn ``[E, out, in]`` and ``weight_scale_inv`` float32
    ``[E, ceil(out/bo), ceil(in/bi)]``: each expert's own block grid, so a stack of two
    matrices along ``out`` (gate then up) needs the first to end on a block boundary (the
    loader checks it).
    """

    def __init__(self, num_experts: int, out_features: int, in_features: int,
                 block: tuple[int, int]) -> None:
        super().__init__()
        self.block = block
        self.register_buffer("weight", torch.empty(num_experts, out_features, in_features,
                                                   dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_inv", torch.empty(
            num_experts, *block_grid(out_features, in_features, block), dtype=torch.float32))

    def __getitem__(self, e: int) -> torch.Tensor:
        """Expert ``e``'s weight ``[out, in]``, float32."""
        return dequantize_block(self.weight[e], self.weight_scale_inv[e], self.block)

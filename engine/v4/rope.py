"""V4's rotary embeddings: interleaved pairs on the TRAILING ``qk_rope_head_dim`` dims of a head.

Two ropes (:class:`engine.v4.config.V4Rope`): ``main`` (sliding layers, plain, theta 10000) and
``compress`` (CSA / HCA layers, their compressors and the indexer: theta 160000 with YaRN, cos
/ sin not rescaled). Maths: YaRN (Peng et al. 2023) as transformers ``_compute_yarn_parameters``
with ``truncate``; pair i of ``x[..., -R:]`` is ``(x[2i], x[2i+1])`` rotated by angle
``pos * inv_freq[i]`` (:func:`engine.rotary.apply_rotary_interleaved`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.rotary import apply_rotary_interleaved
from engine.v4.config import V4Rope


def inv_freq(rope: V4Rope, dim: int) -> torch.Tensor:
    """``[dim // 2]`` fp32 inverse frequencies (YaRN-blended when ``rope.yarn``)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    yarn = rope.yarn
    if yarn is None:
        return extrapolation
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(yarn.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # NOTE: a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: original frequency (extrapolation), 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep


class V4Rotary(nn.Module):
    """cos / sin ``[T, R // 2]`` of one V4 rope over ``R = rope_dim`` dims."""

    def __init__(self, rope: V4Rope, rope_dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq(rope, rope_dim), persistent=False)
        self.attention_factor = rope.attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Int ``positions [T]`` -> (cos, sin) ``[T, R // 2]`` (angles in fp32)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)
        return ((angles.cos() * self.attention_factor).to(dtype),
                (angles.sin() * self.attention_factor).to(dtype))


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, ..., D]`` with its last ``2 * cos.shape[-1]`` dims rotated (fp32 maths);
    ``sin -> -sin`` undoes the rotation."""
    rope_dim = 2 * cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = apply_rotary_interleaved(rope.float(), cos.float(), sin.float()).to(x.dtype)
    return torch.cat((nope, rotated), dim=-1)

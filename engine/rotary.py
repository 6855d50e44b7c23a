"""Rotary position embedding for MLA's rope dims: plain rope or DeepSeek YaRN, interleaved.

Layout (REFERENCE.md "Rope layout"): DeepSeek checkpoints store the rope dims in interleaved
pairs ``(x0, x1), (x2, x3), ...``, pair i rotated by frequency i (GPT-J style). NOTE: the result
stays INTERLEAVED (as DeepSeek's inference code and vLLM), so the cached ``k_pe`` is
interleaved where HF caches ``[evens | odds]``; it is ``KVCacheSpec.rope_layout``. The V3.2
indexer uses the NON-interleaved form (:func:`apply_rotary_half`), GLM-5's the interleaved one.

Maths: YaRN (Peng et al. 2023) as DeepSeek-V3 ``inference/model.py`` and HF
``_compute_yarn_parameters``: inv_freq blends interpolated (``/factor``) and original
frequencies with a linear ramp between the correction dims of ``beta_fast`` and ``beta_slow``;
cos/sin are scaled by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` and the
softmax scale by ``mscale(factor, mscale_all_dim)**2``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine.model_config import ModelConfig, YarnScaling


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature ``0.1 * mscale * ln(factor) + 1`` (1.0 when factor <= 1)."""
    if factor <= 1:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: ModelConfig) -> float:
    """Attention softmax scale: ``qk_head_dim**-0.5 * m**2`` (0.135234 for V3).

    ``m = yarn_get_mscale(factor, mscale_all_dim)`` under YaRN, else 1. The same scale is used
    by MHA prefill and absorbed decode (REFERENCE.md "YaRN rotary and the softmax scale").
    """
    scale = config.qk_head_dim ** -0.5
    if config.rope_scaling is not None:
        m = yarn_get_mscale(config.rope_scaling.factor, config.rope_scaling.mscale_all_dim)
        scale *= m * m
    return scale


def _yarn_inv_freq(dim: int, base: float, yarn: YarnScaling) -> torch.Tensor:
    """YaRN inverse frequencies ``[dim // 2]`` (fp32)."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings
                              / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low)
            / (high - low)).clamp(0, 1)
    freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    # NOTE: ramp 0 -> original frequency (extrapolation), ramp 1 -> interpolated freq / factor.
    return freq / yarn.factor * ramp + freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """Interleaved rotary embedding over ``qk_rope_head_dim`` dims; ``inv_freq`` is made on
    the CPU (move the module with ``.to``).

    NOTE: the CPU even under a ``torch.device("meta")`` context (engine.model.build_model):
    a meta ``arange`` runs torch's Python reference, which imports torch._dynamo, 1.3-2.6 s
    of every rank process's start (measured 2026-12-02).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim, base, yarn = config.qk_rope_head_dim, config.rope_theta, config.rope_scaling
        if yarn is None:
            inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                   device="cpu") / dim)
            self.cos_sin_mscale = 1.0
        else:
            inv_freq = _yarn_inv_freq(dim, base, yarn)
            self.cos_sin_mscale = (yarn_get_mscale(yarn.factor, yarn.mscale)
                                   / yarn_get_mscale(yarn.factor, yarn.mscale_all_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin ``[T, dim // 2]`` for int positions ``[T]`` (angles computed in fp32)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None]
        return ((angles.cos() * self.cos_sin_mscale).to(dtype),
                (angles.sin() * self.cos_sin_mscale).to(dtype))


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x [T, ..., R]`` by ``cos/sin [T, R // 2]``; stays interleaved.

    ``out[2i] = x[2i] cos_i - x[2i+1] sin_i``, ``out[2i+1] = x[2i+1] cos_i + x[2i] sin_i``.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), dim=-1)
    return out.flatten(-2)


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves of ``x [T, ..., R]`` by ``cos/sin [T, R // 2]`` (non-interleaved rope).

    Pair i is ``(x[i], x[i + R/2])``: ``out[i] = x[i] cos_i - x[i+R/2] sin_i``,
    ``out[i+R/2] = x[i+R/2] cos_i + x[i] sin_i`` (HF ``apply_rotary_pos_emb``; the V3.2 indexer).
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

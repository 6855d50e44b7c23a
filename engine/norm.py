"""RMSNorm (Zhang & Sennrich 2019), as in DeepSeek-V3 and HF: normalize in fp32, then scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim (``dim`` wide)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> same shape and dtype. NOTE: ``F.rms_norm`` without a weight
        is the fp32 normalization (one op instead of five), cast back before the scale as HF."""
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

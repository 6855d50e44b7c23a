"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4 paper §2.2, Xie et al. 2026).

The residual is ``hc_mult`` = N streams ``[T, N, hidden]``. Around each block (attention, MoE):
from the RMS-normed flattened streams a linear map ``fn [(2 + N) * N, N * hidden]`` (+ ``base``,
times ``scale[3]``) gives ``pre [N]`` (sigmoid + eps: collapses the streams into the block
input), ``post [N]`` (2 * sigmoid: spreads the block output over the streams) and ``comb [N, N]``
(softmax + eps, then Sinkhorn-Knopp ``hc_sinkhorn_iters`` times: a doubly-stochastic mix of
the input streams). ``streams' = post * out + comb^T @ streams``. The head collapses the
streams once more (``hc_head``: pre weights only) before the final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.v4.attention import unweighted_rms_norm


class HyperConnection(nn.Module):
    """mHC weights of one block (transformers names ``fn``, ``base``, ``scale``)."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = hc_mult, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc_mult) * hc_mult, hc_mult * hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + hc_mult) * hc_mult))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, N, hidden]`` -> (block input ``[T, hidden]``, post ``[T, N]``, comb
        ``[T, N, N]``; post / comb fp32)."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mix = nn.functional.linear(flat, self.fn.float())  # [T, (2+N)*N]
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1)
        comb = comb + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows, then columns, sum to 1
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
        """``post * out + comb^T @ streams`` -> ``[T, N, hidden]`` (block output ``out [T,
        hidden]`` spread over the streams, input streams mixed)."""
        dtype = streams.dtype
        return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
                + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


class HyperHead(nn.Module):
    """Final stream collapse (transformers ``hc_head``: ``hc_fn [N, N * hidden]``,
    ``hc_base [N]``, ``hc_scale [1]``)."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``[T, N, hidden]`` -> ``[T, hidden]``."""
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = nn.functional.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

"""Lightning indexer of DSA (DeepSeek-V3.2, GLM-5): which cached tokens each query attends to.

Maths as transformers 5.x ``DeepseekV32Indexer`` / ``GlmMoeDsaIndexer`` (the bf16/fp32 form of
DeepSeek's FP8 kernel; its Hadamard rotation leaves dot products unchanged, so it is skipped):
``q = rope(wq_b(q_latent))`` per indexer head, ``k = rope(k_norm(wk(x)))`` (one key per token,
what the ``index_k`` cache holds), ``w = weights_proj(x) * n_heads^-0.5``;
``score[s, t] = sum_h w[s, h] * ReLU(q[s, h] . k[t] * index_head_dim^-0.5)`` (fp32); causal
top-``index_topk`` per query. NOTE: the rope form is ``ModelConfig.indexer_rope``: V3.2's is
non-interleaved (half-split), GLM-5's interleaved like MLA's (HF writes its output
de-interleaved, a permutation of q and k alike, so scores are the same; orch keeps the keys
interleaved in ``index_k``). A query with fewer causal tokens keeps them all (= dense MLA).
Replicated over TP, so every rank selects the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.rotary import apply_rotary_half, apply_rotary_interleaved


@dataclass(frozen=True)
class IndexerQuery:
    """The indexer's per-token query side of one step.

    Attributes:
        q: ``[T, Hi, Di]`` roped indexer queries (Hi index_n_heads, Di index_head_dim).
        weights: ``[T, Hi]`` fp32 per-head weights, ``n_heads^-0.5`` folded in.
    """

    q: torch.Tensor
    weights: torch.Tensor

    def rows(self, index: torch.Tensor) -> IndexerQuery:
        """The queries of token rows ``index`` (``[N]`` int64)."""
        return IndexerQuery(self.q[index], self.weights[index])


class Indexer(nn.Module):
    """The lightning indexer of one decoder layer (``config``: DSA, ``index_*`` and
    ``q_lora_rank`` set; rope form ``config.indexer_rope``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.softmax_scale = self.head_dim ** -0.5
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self._apply_rope = apply_rotary_interleaved if config.indexer_rope == "interleaved" \
            else apply_rotary_half

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = self._apply_rope(x[..., : self.rope_dim], cos, sin)
        return torch.cat((rot, x[..., self.rope_dim:]), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys ``[T, Di]`` of normed hidden states ``x [T, hidden]`` (cos/sin
        ``[T, R/2]``): what the ``index_k`` cache stores."""
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> IndexerQuery:
        """Queries and head weights of ``x [T, hidden]`` and MLA's normed q latent
        ``q_latent [T, q_lora_rank]``."""
        q = self.wq_b(q_latent).view(x.shape[0], self.n_heads, self.head_dim)
        weights = self.weights_proj(x).float() * self.n_heads ** -0.5
        return IndexerQuery(self._rope(q, cos, sin), weights)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 softmax_scale: float) -> torch.Tensor:
    """``q [..., T, Hi, Di]``, ``weights [..., T, Hi]`` fp32, ``keys [..., S, Di]`` ->
    ``[..., T, S]`` fp32 ``sum_h weights * ReLU(q . k * softmax_scale)`` (no mask)."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(-3))  # [.,T,Hi,S]
    scores = torch.relu_(scores.mul_(softmax_scale))
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def causal_topk(scores: torch.Tensor, query_pos: torch.Tensor,
                topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``topk`` keys of each query among its causal keys (key j is causal iff
    ``j <= query_pos``); ``scores [T, S]``, ``query_pos [T]`` int64.

    Returns ``(index [T, K], valid [T, K])``, ``K = min(topk, S)``: key positions, False
    where a query has fewer than K causal keys (those point at a masked key).
    """
    k = min(topk, scores.shape[-1])
    key_pos = torch.arange(scores.shape[-1], device=scores.device)
    causal = key_pos[None, :] <= query_pos[:, None]  # [T, S]
    index = scores.masked_fill(~causal, float("-inf")).topk(k, dim=-1).indices
    return index, index <= query_pos[:, None]

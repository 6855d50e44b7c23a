"""DeepSeek-V4 attention (paper §2.3): shared-KV MQA over a sliding window plus compressed
entries, with per-head sinks and a grouped output projection.

Per layer, for queries at positions p (T tokens; H heads; D = head_dim, one K=V head):
``q = RoPE(RMSNorm_unweighted(W_qb RMSNorm(W_qa x)))`` ``[T, H, D]``;
``kv = RoPE(RMSNorm(W_kv x))`` ``[T, D]``, used as key AND value. Keys: the window (a query at
p sees raw kv at p - sliding_window < s <= p) then the compressed entries (HCA: every entry
whose group ended at or before p; CSA: the indexer's top-k among those). Softmax over
``q.k / sqrt(D)`` with one extra learned logit per head (``sinks``, dropped after the softmax,
as gpt-oss). The output's rope dims are rotated back by -p (K=V carried rope into V). Grouped
output projection: heads split into ``o_groups`` groups, each ``[H*D/g] -> [o_lora_rank]``
(``o_a_proj``, block diagonal), then ``o_b_proj [hidden, g * o_lora_rank]``.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.norm import RMSNorm
from engine.quant.fp8_block import dense_weight
from engine.v4.cache import LayerCache
from engine.v4.compressor import Compressor, Indexer, SparseCompressor
from engine.v4.config import CSA, HCA, V4Config
from engine.v4.rope import V4Rotary, rotate_trailing
from engine.v4.tp import output_groups


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim (no weight; fp32 statistics)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Attention(nn.Module):
    """One layer's attention; the kind (``config.layer_types[layer]``) picks the compressor.

    Under TP (``tp`` ranks, :mod:`engine.v4.tp`) it runs ``H / tp`` query heads in
    ``max(o_groups / tp, 1)`` output groups (with tp > o_groups a share of one group:
    :func:`engine.v4.tp.output_groups`; ``q_b_proj``, ``sinks``, ``o_a_proj``, ``o_b_proj``
    hold this rank's part) and returns a PARTIAL sum (the caller all-reduces); K=V, the
    compressor and the indexer are whole, so every rank appends the same state to its (whole)
    cache.
    """

    def __init__(self, config: V4Config, layer: int, tp: int = 1) -> None:
        super().__init__()
        d = config.head_dim
        h, g = config.num_attention_heads // tp, output_groups(config.o_groups, tp)[0]
        self.num_heads, self.head_dim, self.o_groups = h, d, g
        self.sliding_window, self.eps = config.sliding_window, config.rms_norm_eps
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, h * d, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, config.rms_norm_eps)
        self.o_a_proj = nn.Linear(h * d // g, g * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(g * config.o_lora_rank, config.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        kind, ratio = config.layer_types[layer], config.compress_ratio(layer)
        self.compressor: Compressor | None = None
        if kind == HCA:
            self.compressor = Compressor(config.hidden_size, d, ratio, False, self.eps)
        elif kind == CSA:
            indexer = Indexer(config.hidden_size, config.q_lora_rank, config.index_n_heads,
                              config.index_head_dim, ratio, config.index_topk, self.eps)
            self.compressor = SparseCompressor(config.hidden_size, d, ratio, self.eps, indexer)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                lengths: list[int], rotary: V4Rotary) -> torch.Tensor:
        """``x [T, hidden]``: ``lengths[r]`` consecutive tokens of request r after each other,
        at ``positions [T]`` -> ``[T, hidden]``; appends each request's tokens to its
        ``caches[r]`` (window, compressor state). ``rotary``: this layer's rope. Under TP the
        output is this rank's partial sum."""
        # T tokens, H heads, D head_dim, K keys (window + compressed)
        cos, sin = rotary.cos_sin(positions, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))  # [T, q_lora]
        q = self.q_b_proj(q_residual).view(-1, self.num_heads, self.head_dim)
        q = rotate_trailing(unweighted_rms_norm(q, self.eps), cos, sin)  # [T, H, D]
        kv = rotate_trailing(self.kv_norm(self.kv_proj(x)), cos, sin)  # [T, D]
        outs, start = [], 0
        for cache, n in zip(caches, lengths, strict=True):
            seg = slice(start, start + n)
            keys, mask = self._keys(x[seg], kv[seg], q_residual[seg], positions[seg], cache,
                                    rotary)
            outs.append(self._attend(q[seg], keys, mask))  # [n, H, D]
            start += n
        out = rotate_trailing(torch.cat(outs), cos, -sin)  # NOTE: undo the rope V carried
        grouped = out.reshape(out.shape[0], self.o_groups, -1)  # [T, g, H*D/g]
        w = dense_weight(self.o_a_proj, out.dtype).view(self.o_groups, -1, grouped.shape[-1])
        # NOTE: w [g, r_o, H*D/g]; an FP8 o_a_proj (fp8_storage: fp8) dequantized here
        return self.o_b_proj(torch.einsum("tgi,goi->tgo", grouped, w).flatten(1))

    def _keys(self, x: torch.Tensor, kv: torch.Tensor, q_residual: torch.Tensor,
              positions: torch.Tensor, cache: LayerCache, rotary: V4Rotary
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's keys ``[K, D]`` (window, then compressed entries) and ``[n, K]``
        additive mask; appends the request's n tokens to ``cache``."""
        keys = cache.extend_window(kv)  # [w + n, D]
        mask = self._window_mask(positions, keys.shape[0])
        if self.compressor is not None:
            entries, entry_mask = self._compressed(x, q_residual, positions, cache, rotary)
            keys, mask = torch.cat((keys, entries)), torch.cat((mask, entry_mask), dim=-1)
        return keys, mask

    def _window_mask(self, positions: torch.Tensor, num_keys: int) -> torch.Tensor:
        """``[T, w + T]`` additive mask: key s visible to query p iff p - W < s <= p."""
        key_pos = positions[-1] - num_keys + 1 + torch.arange(num_keys, device=positions.device)
        dist = positions[:, None] - key_pos[None]
        visible = (dist >= 0) & (dist < self.sliding_window)
        return torch.zeros(visible.shape, device=positions.device).masked_fill(
            ~visible, float("-inf"))

    def _compressed(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                    cache: LayerCache, rotary: V4Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """All compressed entries ``[E, D]`` and their ``[T, E]`` mask (HCA: causal by group;
        CSA: the indexer's valid top-k)."""
        entries = self.compressor(x, cache.compressor, rotary)
        num = entries.shape[0]
        if isinstance(self.compressor, SparseCompressor):
            top = self.compressor.indexer.select(x, q_residual, positions, cache.indexer, rotary)
            visible = torch.zeros(x.shape[0], num + 1, dtype=torch.bool, device=x.device)
            visible.scatter_(1, torch.where(top >= 0, top, num), True)  # NOTE: num = no pick
            visible = visible[:, :num]
        else:
            ratio = self.compressor.ratio
            visible = torch.arange(num, device=x.device)[None] < (positions[:, None] + 1) // ratio
        mask = torch.zeros(visible.shape, device=x.device).masked_fill(~visible, float("-inf"))
        return entries, mask

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``q [T, H, D]`` over ``keys [K, D]`` (also the values) with an
        additive ``mask [T, K]`` and one sink logit per head -> ``[T, H, D]``."""
        logits = torch.einsum("thd,kd->thk", q, keys) * self.head_dim ** -0.5
        logits = logits + mask[:, None].to(logits.dtype)
        sinks = self.sinks.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1)
        combined = torch.cat((logits, sinks), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1]
        return torch.einsum("thk,kd->thd", probs.to(keys.dtype), keys)

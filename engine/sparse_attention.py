"""DeepSeek-V3.2 sparse MLA (DSA): attention over the indexer's top-k tokens only.

Legend: T query tokens, S causal keys of a sequence (cached prefix + chunk), K = min(index_topk,
S) selected keys per query, U distinct selected keys of a query tile, H local heads,
P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim, L kv_lora_rank, Di index_head_dim.

- Prefill (MHA form): per query tile, the selected latents are decompressed through
  ``kv_b_proj`` once per distinct key, then each query attends to its own K keys. The
  selection spans the cached prefix and the chunk together (the prefix's indexer keys come
  from the ``index_k`` cache), so chunked prefill selects and attends exactly like one shot:
  no log-sum-exp merge is needed.
- Decode (absorbed form): :func:`select_decode_entries` narrows a :class:`DecodeBatch` to
  the selected slots; the ``mla_decode`` kernel then runs unchanged over those entries.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.forward_context import DecodeBatch
from engine.indexer import IndexerQuery, causal_topk, index_scores

ExpandKV = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def attend_selected(q: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                    index: torch.Tensor, valid: torch.Tensor, expand_kv: ExpandKV,
                    scale: float) -> torch.Tensor:
    """MHA-form attention of each query over its selected keys.

    Args:
        q: ``[T, H, P+R]`` queries (rope part interleaved like the cache).
        c_kv: ``[S, L]`` latents and k_pe: ``[S, R]`` roped keys of the sequence's positions.
        index: ``[T, K]`` selected positions; valid: ``[T, K]`` False on filler entries.
        expand_kv: ``(c_kv [U, L], k_pe [U, R]) -> (k [U, H, P+R], v [U, H, V])``.

    Returns:
        ``[T, H, V]``.
    """
    keys, inverse = torch.unique(index, return_inverse=True)  # [U], [T, K]
    k, v = expand_kv(c_kv[keys], k_pe[keys])  # [U, H, D], [U, H, V]
    # NOTE: gathered head-major with index_select (row copies; advanced indexing is ~10x
    # slower on CPU), so both matmuls read them in place.
    k = _gather_rows(k.transpose(0, 1).contiguous(), inverse)  # [H, T, K, D]
    v = _gather_rows(v.transpose(0, 1).contiguous(), inverse)  # [H, T, K, V]
    scores = torch.matmul(q.transpose(0, 1).unsqueeze(-2), k.transpose(-1, -2))  # [H, T, 1, K]
    scores = scores.squeeze(-2).float() * scale
    scores.masked_fill_(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [H, T, K]
    return torch.matmul(probs.unsqueeze(-2), v).squeeze(-2).transpose(0, 1)  # [T, H, V]


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [H, U, W]`` rows at ``index [T, K]`` -> ``[H, T, K, W]``."""
    return x.index_select(1, index.flatten()).view(x.shape[0], *index.shape, x.shape[-1])


def sparse_prefill(q: torch.Tensor, iq: IndexerQuery, positions: torch.Tensor,
                   caches: tuple[torch.Tensor, ...], seq_slots: torch.Tensor, topk: int,
                   softmax_scale: float, expand_kv: ExpandKV, scale: float,
                   query_tile: int) -> torch.Tensor:
    """Sparse attention of one prefill sequence's chunk (the caches already hold the chunk).

    Args:
        q: ``[T, H, P+R]`` MLA queries of the chunk; iq: its indexer queries.
        positions: ``[T]`` int64 positions of the chunk's tokens.
        caches: this layer's (K, V, index_k) caches ``[num_blocks, block_size, width]``.
        seq_slots: ``[S]`` slots of positions ``0..S-1`` (prefix then chunk).
        topk: index_topk; softmax_scale: the indexer's; scale: MLA's softmax scale.
        query_tile: queries scored and attended at a time (memory ``tile * S`` for scores,
            ``tile * K * H * D`` for the gathered keys).

    Returns:
        ``[T, H, V]``.
    """
    c_kv, k_pe, index_k = (c.view(-1, c.shape[-1])[seq_slots] for c in caches)  # [S, *]
    outs = []
    for lo in range(0, q.shape[0], query_tile):
        t = slice(lo, lo + query_tile)
        scores = index_scores(iq.q[t], iq.weights[t], index_k, softmax_scale)  # [t, S]
        index, valid = causal_topk(scores, positions[t], topk)
        outs.append(attend_selected(q[t], c_kv, k_pe, index, valid, expand_kv, scale))
    return torch.cat(outs)


def select_decode_entries(batch: DecodeBatch, iq: IndexerQuery, index_cache: torch.Tensor,
                          topk: int, softmax_scale: float) -> DecodeBatch:
    """The decode batch narrowed to each sequence's top-k cached entries.

    Args:
        batch: slots ``[B, S]`` of positions ``0..context_len`` and ``valid`` ``[B, S]``.
        iq: the B decode tokens' indexer queries (``q [B, Hi, Di]``, ``weights [B, Hi]``).
        index_cache: ``[num_blocks, block_size, Di]`` (already holds the step's tokens).

    Returns:
        a :class:`DecodeBatch` whose ``slots``/``valid`` are ``[B, min(topk, S)]``: a sequence
        with at most ``topk`` positions keeps all of them (dense).
    """
    keys = index_cache.view(-1, index_cache.shape[-1])[batch.slots]  # [B, S, Di]
    scores = index_scores(iq.q[:, None], iq.weights[:, None], keys, softmax_scale)[:, 0]
    scores.masked_fill_(~batch.valid, float("-inf"))  # [B, S]
    index = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices  # [B, K]
    return DecodeBatch(batch.token_index, batch.slots.gather(1, index),
                       batch.valid.gather(1, index))

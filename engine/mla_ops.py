"""MLA attention maths as plain torch functions (registered as kernels in kernels.py).

Legend: T query tokens, S key tokens, H local heads, P qk_nope_head_dim, R qk_rope_head_dim,
V v_head_dim, L kv_lora_rank, D = P + R. Formulas: REFERENCE.md "MLA, naive vs absorbed" and
"Chunked prefill" (DeepSeek-V2 paper, section 2.1; vLLM's MLA backend for the LSE merge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.forward_context import DecodeBatch, SlotSelection


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal attention of a chunk over itself (no cached prefix), via torch SDPA.

    Args:
        q: ``[T, H, D]``; k: ``[T, H, D]``; v: ``[T, H, V]``. Query i sees keys ``0..i``.

    Returns:
        ``[T, H, V]``.
    """
    q4, k4, v4 = _equal_head_dims(q, k, v)
    out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale)
    return out[0, ..., :v.shape[-1]].transpose(0, 1)


def _equal_head_dims(q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[1, H, T, D']`` views of q/k/v, the narrower of D (q, k) and V zero-padded to the
    wider. NOTE: torch's fused (flash) SDPA kernels take only 4-D inputs with one head dim
    for q, k and v; anything else falls back to the math kernel, which materializes the
    ``[H, T, S]`` scores (about 6x slower at 2K tokens on CPU). Zero columns of q/k leave the
    scores unchanged; zero columns of v give zero output columns, sliced off by the caller."""
    d, dv = q.shape[-1], v.shape[-1]
    if dv < d:
        v = F.pad(v, (0, d - dv))
    elif dv > d:
        q, k = F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d))
    return tuple(x.transpose(0, 1)[None] for x in (q, k, v))


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning output and log-sum-exp (for :func:`merge_attention`).

    On CPU: torch's flash kernel (tiled, the scores are never materialized); elsewhere
    explicit fp32 scores ``[H, T, S]``.

    Args:
        q: ``[T, H, D]``; k: ``[S, H, D]``; v: ``[S, H, V]``.
        causal: query i sees keys ``0..i + (S - T)`` (the chunk is the last T of the S keys).

    Returns:
        ``(o [T, H, V], lse [H, T])``, lse of the scaled scores (fp32).
    """
    if q.device.type == "cpu":
        return _flash_with_lse(q, k, v, scale, causal)
    scores = torch.einsum("thd,shd->hts", q * scale, k).float()  # [H, T, S]
    if causal:
        t, s = q.shape[0], k.shape[0]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).triu_(s - t + 1)
        scores.masked_fill_(mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)  # [H, T, 1]
    probs = scores.sub_(row_max).exp_()  # unnormalized, in place
    denom = probs.sum(dim=-1)  # [H, T]
    out = torch.einsum("hts,shv->thv", probs.to(v.dtype), v)
    out = out / denom.transpose(0, 1)[..., None].to(v.dtype)
    return out, row_max.squeeze(-1) + denom.log()


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend_with_lse` by torch's CPU flash kernel (same contract). Its own causal
    flag aligns query i with key i, so a longer key sequence gets an explicit float mask."""
    t, s = q.shape[0], k.shape[0]
    mask = None
    if causal and s != t:
        hidden = torch.ones(t, s, dtype=torch.bool).triu_(s - t + 1)
        mask = torch.zeros(t, s, dtype=q.dtype).masked_fill_(hidden, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_equal_head_dims(q, k, v), 0.0, causal and s == t, attn_mask=mask, scale=scale)
    return out[0, ..., :v.shape[-1]].transpose(0, 1), lse[0]


def merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                    lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two attentions over disjoint key sets (o ``[T, H, V]``, lse ``[H, T]``).

    ``o = (e^lse1 o1 + e^lse2 o2) / (e^lse1 + e^lse2)``, computed stably.

    Returns:
        ``(o [T, H, V], lse [H, T])`` of the attention over the union of the key sets.
    """
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).transpose(0, 1)[..., None]  # [T, H, 1]
    w2 = torch.exp(lse2 - lse).transpose(0, 1)[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype), lse


DECODE_TILE_TOKENS = 256
"""Fewest cached tokens :func:`decode_absorbed` reads and attends at a time per sequence
(rounded down to whole blocks, at least one): 16 blocks of 16."""

DECODE_TILE_BYTES = 16 << 20
"""What one tile of :func:`decode_absorbed` may hold (its c_kv and k_pe gathers and fp32
scores and probabilities): more tokens than ``DECODE_TILE_TOKENS`` per tile when they fit,
so a small batch or short context is one tile (fewer ops per layer). NOTE: 256 tokens at
DeepSeek-V3 tp-8 dims (L 512, R 64, 16 heads) and batch 32 in fp32 are ~20 MiB: that shape
keeps 256-token tiles (docs/performance.md "Paged decode attention")."""


def decode_tile_tokens(batch: int, heads: int, width: int, itemsize: int) -> int:
    """Tokens per :func:`decode_absorbed` tile for ``batch`` sequences of ``heads`` heads over
    cache rows ``width`` (L + R) elements of ``itemsize`` bytes: as many as
    ``DECODE_TILE_BYTES`` holds, at least ``DECODE_TILE_TOKENS``."""
    per_token = batch * (width * itemsize + 2 * heads * 4)  # bytes: gathers + scores, probs
    return max(DECODE_TILE_TOKENS, DECODE_TILE_BYTES // max(1, per_token))


def decode_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, scale: float, *,
                    tile_tokens: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode for B sequences, one query token each (the ``mla_decode`` contract),
    read through the block table a tile of whole blocks (about ``tile_tokens`` tokens) at a
    time, merged with an online softmax.

    Args:
        q_nope: ``[B, H, P]``; q_pe: ``[B, H, R]`` (roped, interleaved like the cache).
        k_cache: ``[num_blocks, block_size, L]``; v_cache: ``[num_blocks, block_size, R]``;
            they already hold this step's tokens.
        batch: ``block_table [B, M]`` and ``seq_lens [B]`` (positions ``0..seq_len-1``).
        w_uk: ``[H, P, L]``; w_uv: ``[H, V, L]`` (kv_b_proj viewed per head).
        tile_tokens: tokens per tile (None: :func:`decode_tile_tokens`, about
            ``DECODE_TILE_BYTES`` of tile); extra memory is ``O(B * H * tile_tokens)`` plus
            ``O(B * tile_tokens * (L + R))`` per call, never ``O(B * M * block_size * L)``.

    Returns:
        ``[B, H, V]`` attention output per head (before o_proj).
    """
    # B seqs, H heads, L kv_lora_rank, R rope dim, n = tile_blocks * block_size tile tokens
    b, h, block_size = q_nope.shape[0], q_nope.shape[1], k_cache.shape[1]
    if tile_tokens is None:
        tile_tokens = decode_tile_tokens(b, h, k_cache.shape[-1] + v_cache.shape[-1],
                                         k_cache.element_size())
    tile_blocks = max(1, tile_tokens // block_size)
    q_lat = torch.einsum("bhp,hpl->bhl", q_nope, w_uk)  # [B, H, L]
    row_max = q_lat.new_full((b, h, 1), float("-inf"), dtype=torch.float32)
    denom = q_lat.new_zeros((b, h, 1), dtype=torch.float32)
    acc = q_lat.new_zeros((b, h, k_cache.shape[-1]), dtype=torch.float32)  # [B, H, L]
    offsets = torch.arange(tile_blocks * block_size, device=q_nope.device)
    # NOTE: every sequence has position 0 in the first tile, so row_max is finite after it
    # and a later all-masked tile adds exp(-inf) = 0 (no NaN from -inf - -inf). Whole blocks
    # are read: the entries past seq_len in a row's last block (stale or never written) are
    # masked out of the scores, but they meet probability 0 in probs @ c_kv, so c_kv must be
    # finite there (the cache is zero-initialized and only ever holds model outputs).
    for lo in range(0, batch.block_table.shape[1], tile_blocks):
        blocks = batch.block_table[:, lo:lo + tile_blocks].flatten()  # [B * nb]
        c_kv = k_cache.index_select(0, blocks).view(b, -1, k_cache.shape[-1])  # [B, n, L]
        k_pe = v_cache.index_select(0, blocks).view(b, -1, v_cache.shape[-1])  # [B, n, R]
        scores = (torch.matmul(q_lat, c_kv.transpose(1, 2))
                  + torch.matmul(q_pe, k_pe.transpose(1, 2))).float() * scale  # [B, H, n]
        pos = lo * block_size + offsets[: c_kv.shape[1]]  # [n]
        scores.masked_fill_((pos[None, :] >= batch.seq_lens[:, None])[:, None, :],
                            float("-inf"))
        new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))
        alpha = torch.exp(row_max - new_max)  # [B, H, 1] rescales what came before
        probs = scores.sub_(new_max).exp_()  # unnormalized, in place
        denom.mul_(alpha).add_(probs.sum(dim=-1, keepdim=True))
        acc.mul_(alpha).add_(torch.matmul(probs.to(c_kv.dtype), c_kv))
        row_max = new_max
        del c_kv, k_pe, scores, probs  # NOTE: before the next tile's gather: one tile alive
    o_lat = (acc / denom).to(q_nope.dtype)  # [B, H, L]
    return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)


def gather_selected_cache(k_cache: torch.Tensor, v_cache: torch.Tensor,
                          sel: SlotSelection) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached c_kv ``[Q, K, L]`` and k_pe ``[Q, K, R]`` at the selection's slots.

    NOTE: index_select (row copies), not advanced indexing: several times faster on CPU.
    """
    slots = sel.slots.flatten()
    c_kv = k_cache.view(-1, k_cache.shape[-1]).index_select(0, slots)
    k_pe = v_cache.view(-1, v_cache.shape[-1]).index_select(0, slots)
    return c_kv.view(*sel.slots.shape, -1), k_pe.view(*sel.slots.shape, -1)


def attend_selected_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, sel: SlotSelection, w_uk: torch.Tensor,
                             w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA of Q single-token queries, each over its own selected slots (the
    ``sparse_decode`` contract; the ``sparse_prefill`` "absorbed" variant). Gathers the
    whole ``[Q, K, L]`` selection at once: for K up to index_topk, or as the padded
    reference of :func:`decode_absorbed`.

    Args:
        q_nope: ``[Q, H, P]``; q_pe: ``[Q, H, R]``.
        k_cache: ``[num_blocks, block_size, L]``; v_cache: ``[num_blocks, block_size, R]``.
        sel: ``slots [Q, K]`` and their ``valid`` mask.
        w_uk: ``[H, P, L]``; w_uv: ``[H, V, L]``.

    Returns:
        ``[Q, H, V]``.
    """
    c_kv, k_pe = gather_selected_cache(k_cache, v_cache, sel)  # [Q, K, L], [Q, K, R]
    q_lat = torch.einsum("bhp,hpl->bhl", q_nope, w_uk)  # [Q, H, L]
    scores = (torch.einsum("bhl,bsl->bhs", q_lat, c_kv)
              + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)).float() * scale
    scores.masked_fill_(~sel.valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(c_kv.dtype)  # [Q, H, K]
    o_lat = torch.einsum("bhs,bsl->bhl", probs, c_kv)
    return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)


def decode_naive(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                 w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """MHA-form decode (decompress every cached token per head); same contract as
    :func:`decode_absorbed`. Slow, kept as the reference for the absorbed path: it gathers
    the padded ``[B, M * block_size, L]`` copy."""
    sel = batch.padded_slots(k_cache.shape[1])
    c_kv, k_pe = gather_selected_cache(k_cache, v_cache, sel)
    k_nope = torch.einsum("bsl,hpl->bshp", c_kv, w_uk)  # [B, S, H, P]
    v = torch.einsum("bsl,hvl->bshv", c_kv, w_uv)  # [B, S, H, V]
    scores = (torch.einsum("bhp,bshp->bhs", q_nope, k_nope)
              + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)).float() * scale
    scores.masked_fill_(~sel.valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhs,bshv->bhv", probs, v)

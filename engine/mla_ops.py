"""MLA attention maths as plain torch functions (registered as kernels in kernels.py).

Legend: T query tokens, S key tokens, H local heads, P qk_nope_head_dim, R qk_rope_head_dim,
V v_head_dim, L kv_lora_rank, D = P + R. Formulas: REFERENCE.md "MLA, naive vs absorbed" and
"Chunked prefill" (DeepSeek-V2 paper, section 2.1; vLLM's MLA backend for the LSE merge).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.forward_context import DecodeBatch


def attend_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Causal attention of a chunk over itself (no cached prefix), via torch SDPA.

    Args:
        q: ``[T, H, D]``; k: ``[T, H, D]``; v: ``[T, H, V]``. Query i sees keys ``0..i``.

    Returns:
        ``[T, H, V]``.
    """
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), is_causal=True, scale=scale)
    return out.transpose(0, 1)


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention returning output and log-sum-exp (for :func:`merge_attention`).

    Args:
        q: ``[T, H, D]``; k: ``[S, H, D]``; v: ``[S, H, V]``.
        causal: query i sees keys ``0..i + (S - T)`` (the chunk is the last T of the S keys).

    Returns:
        ``(o [T, H, V], lse [H, T])``, lse of the scaled scores (fp32).
    """
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


def gather_decode_cache(k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached c_kv ``[B, S, L]`` and k_pe ``[B, S, R]`` of the decode sequences (padded).

    NOTE: index_select (row copies), not advanced indexing: several times faster on CPU.
    """
    slots = batch.slots.flatten()
    c_kv = k_cache.view(-1, k_cache.shape[-1]).index_select(0, slots)
    k_pe = v_cache.view(-1, v_cache.shape[-1]).index_select(0, slots)
    return c_kv.view(*batch.slots.shape, -1), k_pe.view(*batch.slots.shape, -1)


def decode_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                    w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA decode for B sequences, one query token each (the ``mla_decode`` contract).

    Args:
        q_nope: ``[B, H, P]``; q_pe: ``[B, H, R]`` (roped, interleaved like the cache).
        k_cache: ``[num_blocks, block_size, L]``; v_cache: ``[num_blocks, block_size, R]``;
            they already hold this step's tokens.
        batch: slots ``[B, S]`` of positions ``0..context_len`` and their ``valid`` mask.
        w_uk: ``[H, P, L]``; w_uv: ``[H, V, L]`` (kv_b_proj viewed per head).

    Returns:
        ``[B, H, V]`` attention output per head (before o_proj).
    """
    c_kv, k_pe = gather_decode_cache(k_cache, v_cache, batch)  # [B, S, L], [B, S, R]
    q_lat = torch.einsum("bhp,hpl->bhl", q_nope, w_uk)  # [B, H, L]
    scores = (torch.einsum("bhl,bsl->bhs", q_lat, c_kv)
              + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)).float() * scale
    scores.masked_fill_(~batch.valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(c_kv.dtype)  # [B, H, S]
    o_lat = torch.einsum("bhs,bsl->bhl", probs, c_kv)
    return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)


def decode_naive(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                 w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """MHA-form decode (decompress every cached token per head); same contract as
    :func:`decode_absorbed`. Slow, kept as the reference for the absorbed path."""
    c_kv, k_pe = gather_decode_cache(k_cache, v_cache, batch)
    k_nope = torch.einsum("bsl,hpl->bshp", c_kv, w_uk)  # [B, S, H, P]
    v = torch.einsum("bsl,hvl->bshv", c_kv, w_uv)  # [B, S, H, V]
    scores = (torch.einsum("bhp,bshp->bhs", q_nope, k_nope)
              + torch.einsum("bhr,bsr->bhs", q_pe, k_pe)).float() * scale
    scores.masked_fill_(~batch.valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bhs,bshv->bhv", probs, v)

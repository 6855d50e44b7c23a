"""DeepSeek-V3.2 sparse MLA (DSA): attention over the indexer's top-k tokens only.

Legend: T query tokens, S causal keys of a sequence (cached prefix + chunk), K = min(index_topk,
S) selected entries per query, U distinct selected slots, H local heads, P qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, L kv_lora_rank, Di index_head_dim.

Both phases first narrow every query to its selected cache slots, as a :class:`SlotSelection`
(``slots [Q, K]``, ``valid [Q, K]``: one row per query token; for prefill each token of a chunk
is a row of its own), then attend over those latent entries:

- Prefill: the ``sparse_prefill`` kernel, MHA form by default (:func:`sparse_prefill_mha`:
  each distinct selected latent decompressed once through ``kv_b_proj``); variant
  ``absorbed`` is :func:`engine.mla_ops.attend_selected_absorbed` (fewer bytes gathered per
  query).
  The selection spans the cached prefix and the chunk together (the prefix's indexer keys
  come from the ``index_k`` cache), so chunked prefill selects and attends exactly like one
  shot: prefix and chunk keys share one softmax, no log-sum-exp merge is needed.
- Decode: the ``sparse_decode`` kernel (absorbed: :func:`engine.mla_ops.attend_selected_absorbed`)
  over the selected entries; the selection scores every position of the block table's padded
  slot list (:meth:`DecodeBatch.padded_slots`), so V3.2 decode is exactly the dense selection.

GLM-5.2's shared layers (``ModelConfig.indexer_types``) select nothing: the step's
:class:`SharedSelection` hands them the selections the last full layer made (slots are the same
in every layer's cache, so a selection of slots is valid in all of them).
"""

from __future__ import annotations

import torch

from engine.forward_context import DecodeBatch, SlotSelection
from engine.indexer import IndexerQuery, causal_topk, index_scores


class SharedSelection:
    """The top-k selections of one step, each kept by the layer that made it for the shared
    layers after it (a new full layer replaces them). Keys: ``("prefill", first_row, tile)``
    per query tile, ``"decode"`` for the decode batch; values are what the selection
    functions return."""

    def __init__(self) -> None:
        self._made: dict[object, object] = {}

    def put(self, key: object, selection: object) -> None:
        """Keep ``selection`` under ``key`` (a full layer's, replacing the previous one's)."""
        self._made[key] = selection

    def get(self, key: object) -> object:
        """The selection a full layer made under ``key``.

        Raises:
            RuntimeError: no full layer ran before (``indexer_types`` must start "full").
        """
        if key not in self._made:
            raise RuntimeError(f"a shared DSA layer found no selection {key!r} of an earlier "
                               "full layer this step: indexer_types must start with 'full'")
        return self._made[key]


def select_prefill_entries(iq: IndexerQuery, positions: torch.Tensor, index_k: torch.Tensor,
                           seq_slots: torch.Tensor, topk: int,
                           softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k cache slots of T queries of one sequence.

    Args:
        iq: the queries' indexer side (``q [T, Hi, Di]``, ``weights [T, Hi]``).
        positions: ``[T]`` int64 positions of the queries.
        index_k: ``[S, Di]`` indexer keys of positions ``0..S-1``; seq_slots: their ``[S]`` slots.

    Returns:
        ``(slots [T, K], valid [T, K])``; valid is False on filler entries of queries with
        fewer than K causal positions.
    """
    scores = index_scores(iq.q, iq.weights, index_k, softmax_scale)  # [T, S]
    index, valid = causal_topk(scores, positions, topk)
    return seq_slots[index], valid


def select_decode_entries(batch: DecodeBatch, iq: IndexerQuery, index_cache: torch.Tensor,
                          topk: int, softmax_scale: float) -> SlotSelection:
    """The decode batch narrowed to each sequence's top-k cached entries.

    Args:
        batch: ``block_table [B, M]`` and ``seq_lens [B]`` (positions ``0..context_len``).
        iq: the B decode tokens' indexer queries (``q [B, Hi, Di]``, ``weights [B, Hi]``).
        index_cache: ``[num_blocks, block_size, Di]`` (already holds the step's tokens).

    Returns:
        a :class:`SlotSelection` whose ``slots``/``valid`` are ``[B, min(topk, S)]``
        (``S = M * block_size``): a sequence with at most ``topk`` positions keeps all of
        them (dense); filler entries are not valid.
    """
    padded = batch.padded_slots(index_cache.shape[1])  # [B, S]
    keys = index_cache.view(-1, index_cache.shape[-1])[padded.slots]  # [B, S, Di]
    scores = index_scores(iq.q[:, None], iq.weights[:, None], keys, softmax_scale)[:, 0]
    scores.masked_fill_(~padded.valid, float("-inf"))  # [B, S]
    index = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices  # [B, K]
    return SlotSelection(batch.token_index, padded.slots.gather(1, index),
                         padded.valid.gather(1, index))


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [H, U, W]`` rows at ``index [Q, K]`` -> ``[H, Q, K, W]`` (index_select: row copies;
    advanced indexing is several times slower on CPU)."""
    return x.index_select(1, index.flatten()).view(x.shape[0], *index.shape, x.shape[-1])


def sparse_prefill_mha(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, batch: SlotSelection, w_uk: torch.Tensor,
                       w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """MHA-form attention of Q queries, each over its own selected entries (the
    ``sparse_prefill`` contract, same as ``sparse_decode``'s).

    Args:
        q_nope: ``[Q, H, P]``; q_pe: ``[Q, H, R]`` (roped, interleaved like the cache).
        k_cache: ``[num_blocks, block_size, L]``; v_cache: ``[num_blocks, block_size, R]``.
        batch: per query ``slots [Q, K]`` and ``valid [Q, K]`` (at least one valid each).
        w_uk: ``[H, P, L]``; w_uv: ``[H, V, L]`` (kv_b_proj viewed per head).

    Returns:
        ``[Q, H, V]``.
    """
    slots, inverse = torch.unique(batch.slots, return_inverse=True)  # [U], [Q, K]
    c_kv = k_cache.view(-1, k_cache.shape[-1])[slots]  # [U, L]
    k_pe = v_cache.view(-1, v_cache.shape[-1])[slots]  # [U, R]
    h = w_uk.shape[0]
    k = torch.cat((torch.einsum("ul,hpl->hup", c_kv, w_uk),
                   k_pe[None].expand(h, -1, -1)), dim=-1)  # [H, U, P+R]
    v = torch.einsum("ul,hvl->huv", c_kv, w_uv)  # [H, U, V]
    # NOTE: gathered head-major so both matmuls read them in place (no permuted copies).
    k, v = _gather_rows(k, inverse), _gather_rows(v, inverse)  # [H, Q, K, P+R], [H, Q, K, V]
    q = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1).unsqueeze(-2)  # [H, Q, 1, P+R]
    scores = torch.matmul(q, k.transpose(-1, -2)).squeeze(-2).float() * scale  # [H, Q, K]
    scores.masked_fill_(~batch.valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs.unsqueeze(-2), v).squeeze(-2).transpose(0, 1)  # [Q, H, V]

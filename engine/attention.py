"""Multi-head Latent Attention (MLA, DeepSeek-V2 paper section 2.1) over the paged KV cache.

Names follow DeepSeek/HF checkpoints (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``, ``o_proj``). Per step, for T flattened tokens:

- ``c_kv = kv_a_layernorm(kv_a[:, :L])`` and ``k_pe = rope(kv_a[:, L:])`` (and, for
  DeepSeek-V3.2, the lightning indexer's keys) are written into the layer's K and V (and
  index_k) caches with ONE ``reshape_and_cache`` call (all T tokens, one write per buffer).
- Prefill sequences: MHA form (``k_nope``, ``v`` from ``kv_b_proj``), causal attention over
  the chunk, plus non-causal attention over the cached prefix (decompressed from the latent
  cache), merged by log-sum-exp.
- Decode sequences: the ``mla_decode`` kernel (absorbed form by default) over the cache
  through the step's block tables (``meta.decode``); the cache already holds the step's own
  token.
- DSA (V3.2, GLM-5: ``config.uses_sparse_attention``): the layer's :class:`Indexer` picks
  each query's top ``index_topk`` causal tokens and both forms attend to those only
  (:mod:`engine.sparse_attention`); a GLM-5.2 shared layer (no indexer, no index_k cache)
  reuses the last full layer's selection from the step's :class:`SharedSelection`.

Context parallel (``meta.cp``, :mod:`engine.context_parallel`): the module sees only this
rank's tokens, with all heads; the latents of the step's tokens are all-gathered before the
one cache write, so the cache holds them all, and each local piece attends causally to the
chunk up to its end plus the cached prefix.

TP: the module holds ``num_heads`` heads (this rank's, per :mod:`engine.layout`: head-major
rows of ``q_b_proj``/``q_proj``/``kv_b_proj``, columns of ``o_proj``); ``forward`` returns
this rank's PARTIAL ``o_proj`` output: the caller all-reduces.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.context_parallel import CPStep
from engine.forward_context import AttentionMetadata, SlotSelection
from engine.indexer import Indexer, IndexerQuery
from engine.kernels import KernelSet
from engine.mla_ops import attend_causal, attend_with_lse, merge_attention
from engine.model_config import ModelConfig
from engine.norm import RMSNorm
from engine.prefill_graph import mla_prefill, register_prefill_layer
from engine.rotary import apply_rotary_interleaved, softmax_scale
from engine.sparse_attention import (SharedSelection, select_decode_entries,
                                     select_prefill_entries)

LATENT_NORM_EPS = 1e-6
"""eps of ``q_a_layernorm`` / ``kv_a_layernorm``: fixed, not ``rms_norm_eps`` (DeepSeek's and
transformers' MLA build both norms with the default 1e-6; GLM-5's rms_norm_eps is 1e-5)."""


class MLAttention(nn.Module):
    """MLA of one decoder layer over ``num_heads`` of the model's heads.

    Args:
        config: model config. num_heads: this rank's heads (``TPLayout.num_attention_heads``).
        kernels: resolved kernels. layer_idx: the decoder layer (its indexer kind).

    Attributes:
        prefix_tile: cached-prefix tokens decompressed and attended at a time (chunked prefill).
        query_tile: queries scored and attended at a time by sparse (V3.2) prefill.
        indexer: the DSA lightning indexer, None for V2/V3 and DSA shared layers.
        sparse: True under DSA (attends to a top-k selection, its own or a shared one).
    """

    prefix_tile: int = 4096
    query_tile: int = 128

    def __init__(self, config: ModelConfig, num_heads: int, kernels: KernelSet,
                 layer_idx: int = 0) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_local_heads = h = num_heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        self.scale = softmax_scale(config)
        hidden, d = config.hidden_size, config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * d, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * d, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank,
                                   h * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_head_dim, hidden, bias=False)
        self.sparse = config.uses_sparse_attention
        self.indexer = Indexer(config) if config.has_indexer(layer_idx) else None
        self.layer_idx = layer_idx
        self.graph_key = register_prefill_layer(self)  # NOTE: the prefill graph's op

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, caches: tuple[torch.Tensor, ...],
                shared: SharedSelection | None = None) -> torch.Tensor:
        """Attention of one step.

        Args:
            x: ``[T, hidden]`` normed hidden states. cos, sin: ``[T, R/2]`` at meta.positions.
                Under CP (``meta.cp``) T is this rank's local rows (``meta.cp.local_rows``).
            caches: this layer's K ``[num_blocks, block_size, L]``, V ``[.., R]`` and, with
                an indexer, index_k ``[.., Di]`` (``KVCache.layer_buffers``).
            shared: the step's selections (DSA: full layers put, shared layers get); a
                private one when None.

        Returns:
            ``[T, hidden]`` partial (this rank's heads) o_proj output.
        """
        # T tokens, H local heads, P nope, R rope, V v_head_dim, L kv_lora_rank
        t, h, p = x.shape[0], self.num_local_heads, self.qk_nope_head_dim
        if self.q_lora_rank is None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank]
            q = self.q_b_proj(q_latent)
        q = q.view(t, h, p + self.qk_rope_head_dim)
        q_nope = q[..., :p]  # [T, H, P]
        q_pe = apply_rotary_interleaved(q[..., p:], cos, sin)  # [T, H, R]
        kv_a = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank])  # [T, L]
        k_pe = apply_rotary_interleaved(kv_a[:, self.kv_lora_rank:], cos, sin)  # [T, R]
        entries = (c_kv, k_pe)
        iq = None
        if self.indexer is not None:
            entries += (self.indexer.keys(x, cos, sin),)  # [T, Di]
            iq = self.indexer.queries(x, q_latent, cos, sin)
        if meta.cp is not None:  # T local rows -> the step's latents, all of them
            entries = self._gather_latents(entries, meta.cp)
        self.kernels.reshape_and_cache(entries, caches, meta.slot_mapping)
        meta.kv_written(self.layer_idx)

        out = x.new_empty(t, h, self.v_head_dim)  # [T, H, V]
        shared = SharedSelection() if shared is None else shared
        if meta.cp is not None:
            self._prefill_cp(out, q_nope, q_pe, iq, entries, meta, caches, shared)
        elif meta.prefill_pack is not None:  # NOTE: the prefill graph (engine/prefill_graph.py)
            out = mla_prefill(torch.cat((q_nope, q_pe), dim=-1), *self._expand_kv(c_kv, k_pe),
                              caches[0], caches[1], meta.prefill_pack, self.graph_key)
        elif meta.prefills and self.sparse:
            self._prefill_sparse(out, q_nope, q_pe, iq, meta, caches, shared)
        elif meta.prefills:
            self._prefill(out, q_nope, q_pe, c_kv, k_pe, meta, caches[0], caches[1])
        if meta.decode is not None:
            self._decode(out, q_nope, q_pe, iq, meta, caches, shared)
        return self.o_proj(out.view(t, h * self.v_head_dim))

    def _expand_kv(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """MHA keys ``[S, H, P+R]``, values ``[S, H, V]`` from c_kv ``[S, L]``, k_pe ``[S, R]``."""
        s, h, p = c_kv.shape[0], self.num_local_heads, self.qk_nope_head_dim
        kv = self.kv_b_proj(c_kv).view(s, h, p + self.v_head_dim)
        k = torch.cat((kv[..., :p], k_pe[:, None, :].expand(s, h, self.qk_rope_head_dim)), -1)
        return k, kv[..., p:]

    def _prefill(self, out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                 c_kv: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Fill ``out [T, H, V]`` rows of the prefill sequences (chunk causal + cached prefix,
        LSE merge). q_nope ``[T, H, P]``, q_pe ``[T, H, R]``, c_kv ``[T, L]``, k_pe ``[T, R]``."""
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, P+R]
        k, v = self._expand_kv(c_kv, k_pe)  # [T, H, P+R], [T, H, V]
        self.prefill_rows(out, q, k, v,
                          [(seq.start, seq.end, seq.prefix_slots) for seq in meta.prefills],
                          k_cache, v_cache)

    def prefill_rows(self, out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, seqs: list[tuple[int, int, torch.Tensor]],
                     k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Fill ``out [T, H, V]`` rows of ``seqs`` (``(start, end, prefix_slots [ctx] int64)``
        each: rows ``[start, end)`` after a cached prefix at those slots) with the attention of
        ``q [T, H, P+R]`` over the rows' own keys ``k [T, H, P+R]`` / values ``v [T, H, V]``
        (causal) and the prefix read from ``k_cache`` / ``v_cache``, LSE-merged. The eager
        maths of the prefill graph's op too (engine/prefill_graph.py)."""
        for start, end, prefix_slots in seqs:
            rows = slice(start, end)
            out[rows] = self._attend(q[rows], k[rows], v[rows], prefix_slots.to(k_cache.device),
                                     k_cache, v_cache)

    def _attend_chunk(self, out: torch.Tensor, rows: slice, q: torch.Tensor,
                      c_kv: torch.Tensor, k_pe: torch.Tensor, prefix_slots: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """``out[rows] =`` attention of queries ``q [n, H, P+R]``, the LAST n of the chunk
        tokens ``c_kv [s, L]``, ``k_pe [s, R]`` (causal among those n), over themselves, the
        ``s - n`` chunk tokens before them and the cached prefix at ``prefix_slots [ctx]``
        (read from the latent cache), LSE-merged."""
        n, s = q.shape[0], c_kv.shape[0]
        k, v = self._expand_kv(c_kv[s - n:], k_pe[s - n:])
        out[rows] = self._attend(q, k, v, prefix_slots, k_cache, v_cache,
                                 (c_kv[:s - n], k_pe[:s - n]))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                prefix_slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                earlier: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``[n, H, V]``: queries ``q [n, H, P+R]`` over their own keys ``k`` / values ``v``
        (causal), the cached prefix at ``prefix_slots [ctx]`` and the ``earlier`` chunk tokens
        before them (``(c_kv [e, L], k_pe [e, R])``, none when None), LSE-merged."""
        e = 0 if earlier is None else earlier[0].shape[0]
        if prefix_slots.numel() == 0 and e == 0:
            return attend_causal(q, k, v, self.scale)
        o, lse = attend_with_lse(q, k, v, self.scale, causal=True)
        flat_k = k_cache.view(-1, self.kv_lora_rank)
        flat_v = v_cache.view(-1, self.qk_rope_head_dim)
        # NOTE: the earlier keys (cached prefix, then the chunk before these queries) are
        # decompressed and attended in tiles of prefix_tile tokens, the prefix read from the
        # latent cache, so memory stays O(n * tile), never a padded full-sequence tensor.
        for tile in (prefix_slots.split(self.prefix_tile) if prefix_slots.numel() else ()):
            o, lse = self._merge_tile(q, o, lse, flat_k[tile], flat_v[tile])
        for lo in range(0, e, self.prefix_tile):
            hi = min(lo + self.prefix_tile, e)
            o, lse = self._merge_tile(q, o, lse, earlier[0][lo:hi], earlier[1][lo:hi])
        return o

    def _merge_tile(self, q: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                    c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(o, lse)`` of ``q`` merged with its attention over earlier keys ``c_kv [S, L]``,
        ``k_pe [S, R]`` (all visible)."""
        k_pre, v_pre = self._expand_kv(c_kv, k_pe)
        o_pre, lse_pre = attend_with_lse(q, k_pre, v_pre, self.scale, causal=False)
        return merge_attention(o, lse, o_pre, lse_pre)

    def _prefill_sparse(self, out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                        iq: IndexerQuery | None, meta: AttentionMetadata,
                        caches: tuple[torch.Tensor, ...], shared: SharedSelection) -> None:
        """Fill ``out [T, H, V]`` rows of the prefill sequences with the ``sparse_prefill``
        kernel over each query's top-k of prefix + chunk (the caches hold the chunk)."""
        for seq in meta.prefills:
            seq_slots = torch.cat((seq.prefix_slots, meta.slot_mapping[seq.start:seq.end]))
            rows = torch.arange(seq.start, seq.end, device=out.device)
            self._attend_sparse(out, q_nope, q_pe, iq, caches, seq_slots, rows,
                                meta.positions[seq.start:seq.end], (shared, seq.start))

    def _attend_sparse(self, out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                       iq: IndexerQuery | None, caches: tuple[torch.Tensor, ...],
                       seq_slots: torch.Tensor, rows: torch.Tensor,
                       positions: torch.Tensor, share: tuple[SharedSelection, int]) -> None:
        """``out[rows] =`` sparse attention of query rows ``rows [n]`` (at ``positions [n]``)
        over their top-k of ``seq_slots [S]`` (positions ``0..S-1``, cached), in tiles of
        ``query_tile`` queries. ``share``: the step's selections and the first row's index
        (the key of this layer's selections: put with an indexer, else got)."""
        (shared, first), (w_uk, w_uv) = share, self._w_kvb()
        index_k = None if self.indexer is None \
            else caches[2].view(-1, caches[2].shape[-1])[seq_slots]  # [S, Di]
        for lo in range(0, rows.numel(), self.query_tile):
            tile = rows[lo:lo + self.query_tile]
            key = ("prefill", first, lo)
            if index_k is None:
                slots, valid = shared.get(key)
            else:
                slots, valid = select_prefill_entries(
                    iq.rows(tile), positions[lo:lo + self.query_tile], index_k, seq_slots,
                    self.indexer.topk, self.indexer.softmax_scale)
                shared.put(key, (slots, valid))
            # NOTE: each query token is a row of its own with its own slot list.
            out[tile] = self.kernels.sparse_prefill(
                q_nope[tile], q_pe[tile], caches[0], caches[1],
                SlotSelection(tile, slots, valid), w_uk, w_uv, self.scale)

    @staticmethod
    def _gather_latents(entries: tuple[torch.Tensor, ...],
                        cp: CPStep) -> tuple[torch.Tensor, ...]:
        """Local ``(c_kv [t, L], k_pe [t, R][, index_k [t, Di]])`` -> the same of all T tokens
        of the step in token order (one all-gather of the entries side by side)."""
        widths = [e.shape[-1] for e in entries]
        return cp.gather_rows(torch.cat(entries, dim=-1)).split(widths, dim=-1)

    def _prefill_cp(self, out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                    iq: IndexerQuery | None, entries: tuple[torch.Tensor, ...],
                    meta: AttentionMetadata, caches: tuple[torch.Tensor, ...],
                    shared: SharedSelection) -> None:
        """Fill ``out [t, H, V]`` (local rows) piece by piece: each piece of the chunk is a
        prefill of its own whose context is the prefix plus the chunk before it; entries are
        the step's gathered latents ``[T, ...]`` (the caches already hold them)."""
        for piece in meta.cp.pieces:
            seq, rows = piece.seq, piece.local_rows
            full = slice(seq.start + piece.lo, seq.start + piece.hi)
            if self.sparse:
                seq_slots = torch.cat((seq.prefix_slots, meta.slot_mapping[seq.start:full.stop]))
                local = torch.arange(rows.start, rows.stop, device=out.device)
                self._attend_sparse(out, q_nope, q_pe, iq, caches, seq_slots, local,
                                    meta.positions[full], (shared, rows.start))
                continue
            c_kv, k_pe = (e[seq.start:full.stop] for e in entries[:2])
            self._attend_chunk(out, rows, torch.cat((q_nope[rows], q_pe[rows]), dim=-1),
                               c_kv, k_pe, seq.prefix_slots, caches[0], caches[1])

    def _w_kvb(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` viewed per head: ``(W_UK [H, P, L], W_UV [H, V, L])``."""
        h, p = self.num_local_heads, self.qk_nope_head_dim
        w_kvb = self.kv_b_proj.weight.view(h, p + self.v_head_dim, self.kv_lora_rank)
        return w_kvb[:, :p], w_kvb[:, p:]

    def _decode(self, out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                iq: IndexerQuery | None, meta: AttentionMetadata,
                caches: tuple[torch.Tensor, ...], shared: SharedSelection) -> None:
        """Fill ``out [T, H, V]`` rows of the decode sequences: the ``mla_decode`` kernel over
        every cached token through the block table (V3), or the ``sparse_decode`` kernel over
        the indexer's top-k entries (DSA; a shared layer's from ``shared``)."""
        dec = meta.decode
        rows = dec.token_index
        if not self.sparse:
            if rows.shape[0] == out.shape[0]:  # NOTE: every row decodes: rows are 0..T-1
                rows = slice(None)  # views, no gathers and no index_put
            out[rows] = self.kernels.mla_decode(q_nope[rows], q_pe[rows], caches[0], caches[1],
                                                dec, *self._w_kvb(), self.scale)
            return
        if iq is None:
            sel = shared.get("decode")
        else:
            sel = select_decode_entries(dec, iq.rows(rows), caches[2], self.indexer.topk,
                                        self.indexer.softmax_scale)
            shared.put("decode", sel)
        out[rows] = self.kernels.sparse_decode(q_nope[rows], q_pe[rows], caches[0], caches[1],
                                               sel, *self._w_kvb(), self.scale)

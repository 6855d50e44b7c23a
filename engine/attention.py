"""Multi-head Latent Attention (MLA, DeepSeek-V2 paper section 2.1) over the paged KV cache.

Names follow DeepSeek/HF checkpoints (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_b_proj``, ``o_proj``). Per step, for T flattened tokens:

- ``c_kv = kv_a_layernorm(kv_a[:, :L])`` and ``k_pe = rope(kv_a[:, L:])`` are written into the
  layer's K and V caches with ONE ``reshape_and_cache`` call (all T tokens).
- Prefill sequences: MHA form (``k_nope``, ``v`` from ``kv_b_proj``), causal attention over
  the chunk, plus non-causal attention over the cached prefix (decompressed from the latent
  cache), merged by log-sum-exp.
- Decode sequences: the ``mla_decode`` kernel (absorbed form by default) over the cache,
  which already holds the step's own token.

TP: the module holds ``num_heads`` heads (this rank's, per :mod:`engine.layout`: head-major
rows of ``q_b_proj``/``q_proj``/``kv_b_proj``, columns of ``o_proj``); ``forward`` returns
this rank's PARTIAL ``o_proj`` output: the caller all-reduces.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.forward_context import AttentionMetadata
from engine.kernels import KernelSet
from engine.mla_ops import attend_causal, attend_with_lse, merge_attention
from engine.model_config import ModelConfig
from engine.norm import RMSNorm
from engine.rotary import apply_rotary_interleaved, softmax_scale


class MLAttention(nn.Module):
    """MLA of one decoder layer over ``num_heads`` of the model's heads.

    Args:
        config: model config. num_heads: this rank's heads (``TPLayout.num_attention_heads``).
        kernels: resolved kernels.

    Attributes:
        prefix_tile: cached-prefix tokens decompressed and attended at a time (chunked prefill).
    """

    prefix_tile: int = 4096

    def __init__(self, config: ModelConfig, num_heads: int, kernels: KernelSet) -> None:
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
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * d, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank,
                                   h * (self.qk_nope_head_dim + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor,
                v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of one step.

        Args:
            x: ``[T, hidden]`` normed hidden states. cos, sin: ``[T, R/2]`` at meta.positions.
            k_cache: ``[num_blocks, block_size, L]``; v_cache: ``[num_blocks, block_size, R]``.

        Returns:
            ``[T, hidden]`` partial (this rank's heads) o_proj output.
        """
        # T tokens, H local heads, P nope, R rope, V v_head_dim, L kv_lora_rank
        t, h, p = x.shape[0], self.num_local_heads, self.qk_nope_head_dim
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, p + self.qk_rope_head_dim)
        q_nope = q[..., :p]  # [T, H, P]
        q_pe = apply_rotary_interleaved(q[..., p:], cos, sin)  # [T, H, R]
        kv_a = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv_a[:, : self.kv_lora_rank])  # [T, L]
        k_pe = apply_rotary_interleaved(kv_a[:, self.kv_lora_rank:], cos, sin)  # [T, R]
        self.kernels.reshape_and_cache(c_kv, k_pe, k_cache, v_cache, meta.slot_mapping)

        out = x.new_empty(t, h, self.v_head_dim)  # [T, H, V]
        if meta.prefills:
            self._prefill(out, q_nope, q_pe, c_kv, k_pe, meta, k_cache, v_cache)
        if meta.decode is not None:
            self._decode(out, q_nope, q_pe, meta, k_cache, v_cache)
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
        flat_k = k_cache.view(-1, self.kv_lora_rank)
        flat_v = v_cache.view(-1, self.qk_rope_head_dim)
        for seq in meta.prefills:
            rows = slice(seq.start, seq.end)
            k, v = self._expand_kv(c_kv[rows], k_pe[rows])
            if seq.context_len == 0:
                out[rows] = attend_causal(q[rows], k, v, self.scale)
                continue
            o, lse = attend_with_lse(q[rows], k, v, self.scale, causal=True)
            # NOTE: the prefix is read from the latent cache, never a padded full-sequence
            # tensor, in tiles of prefix_tile tokens so memory stays O(chunk * tile).
            for tile in seq.prefix_slots.split(self.prefix_tile):
                k_pre, v_pre = self._expand_kv(flat_k[tile], flat_v[tile])
                o_pre, lse_pre = attend_with_lse(q[rows], k_pre, v_pre, self.scale, causal=False)
                o, lse = merge_attention(o, lse, o_pre, lse_pre)
            out[rows] = o

    def _decode(self, out: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
                meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Fill ``out [T, H, V]`` rows of the decode sequences with the ``mla_decode`` kernel."""
        dec = meta.decode
        h, p = self.num_local_heads, self.qk_nope_head_dim
        w_kvb = self.kv_b_proj.weight.view(h, p + self.v_head_dim, self.kv_lora_rank)
        out[dec.token_index] = self.kernels.mla_decode(
            q_nope[dec.token_index], q_pe[dec.token_index], k_cache, v_cache, dec,
            w_kvb[:, :p], w_kvb[:, p:], self.scale)

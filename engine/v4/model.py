"""The DeepSeek-V4 decoder (``DeepseekV4ForCausalLM``): embeddings spread over ``hc_mult``
streams, layers of (mHC, attention, mHC, MoE), the head's stream collapse, RMSNorm, lm_head.

Parameter names are transformers' (``model.layers.{i}.self_attn.q_a_proj.weight``, ...);
:mod:`engine.v4.loader` maps DeepSeek's released names onto them. Under TP (a
:class:`engine.parallel.TPGroup` of size > 1) the modules hold this rank's parts
(:mod:`engine.v4.tp`): each layer all-reduces the attention's and the MoE's partial sums, the
vocab-parallel embedding all-reduces and lm_head all-gathers; the hyper-connection streams and
every rank's V4 cache are whole and equal on every rank. Under EP (an
:class:`engine.parallel.EPGroup` of size > 1, over a role's dp x tp ranks) each layer holds
only this EP rank's whole routed experts (:mod:`engine.v4.expert_parallel`). The MTP layer
(``num_nextn_predict_layers``) is not built (transformers does not build it either).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.norm import RMSNorm
from engine.parallel import EPGroup, TPGroup
from engine.v4.attention import V4Attention
from engine.v4.cache import LayerCache, V4Cache
from engine.v4.config import SLIDING, V4Config
from engine.v4.expert_parallel import ep_experts
from engine.v4.hyper_connection import HyperConnection, HyperHead
from engine.v4.moe import V4MoE
from engine.v4.rope import V4Rotary


def v4_rotaries(config: V4Config) -> nn.ModuleDict:
    """The two ropes (``main``: sliding layers, ``compress``: compressed ones), built on the
    current default device (their ``inv_freq`` is not in the checkpoint)."""
    return nn.ModuleDict({"main": V4Rotary(config.main_rope, config.qk_rope_head_dim),
                          "compress": V4Rotary(config.compress_rope, config.qk_rope_head_dim)})


class V4DecoderLayer(nn.Module):
    """(attn_hc, input_layernorm, self_attn), (ffn_hc, post_attention_layernorm, mlp); under
    EP (``ep.size > 1``) the mlp holds only this rank's routed experts."""

    def __init__(self, config: V4Config, layer: int, tp: TPGroup,
                 ep: EPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps,
              config.rms_norm_eps)
        self.rope_kind = "main" if config.layer_types[layer] == SLIDING else "compress"
        self.attn_hc, self.ffn_hc = HyperConnection(*hc), HyperConnection(*hc)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = V4Attention(config, layer, tp.size)
        self.mlp = V4MoE(config, layer, tp.size, ep_experts(config, ep, tp))

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list[LayerCache], lengths: list[int], rotary: V4Rotary) -> torch.Tensor:
        """``streams [T, N, hidden]`` -> same shape; appends each request's tokens to its
        cache (see :meth:`V4Attention.forward`)."""
        x, post, comb = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(x), positions, caches, lengths, rotary)
        streams = HyperConnection.merge(streams, self.tp.all_reduce(out), post, comb)
        x, post, comb = self.ffn_hc(streams)
        out = self.tp.all_reduce(self.mlp(self.post_attention_layernorm(x), input_ids))
        return HyperConnection.merge(streams, out, post, comb)


class V4Model(nn.Module):
    """``embed_tokens`` (this rank's vocab rows), ``layers``, ``hc_head``, ``norm``
    (transformers ``model.*``)."""

    def __init__(self, config: V4Config, tp: TPGroup, ep: EPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.embed_tokens = nn.Embedding(config.vocab_size // tp.size, config.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(config, i, tp, ep)
                                    for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps,
                                 config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]``; under TP each rank looks up the ids of its
        vocab part (zero rows for the others) and the ranks' rows are summed."""
        if self.tp.size == 1:
            return self.embed_tokens(input_ids)
        n = self.embed_tokens.num_embeddings
        local = input_ids - self.tp.rank * n
        mine = (local >= 0) & (local < n)
        x = self.embed_tokens(torch.where(mine, local, 0)) * mine[:, None].to(
            self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 over per-request :class:`engine.v4.cache.V4Cache` objects; ``tp``: this
    rank's TP group (None: one rank; its size must pass :func:`engine.v4.tp.check_tp`);
    ``ep`` (size > 1): this EP rank's routed experts only, every forward a collective over the
    group (:mod:`engine.v4.expert_parallel`)."""

    def __init__(self, config: V4Config, tp: TPGroup | None = None,
                 ep: EPGroup | None = None) -> None:
        super().__init__()
        self.config, self.tp = config, tp or TPGroup()
        self.model = V4Model(config, self.tp, ep)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // self.tp.size,
                                 bias=False)
        self.rotary = v4_rotaries(config)

    def new_cache(self) -> V4Cache:
        """An empty cache in this model's dtype / device."""
        weight = self.lm_head.weight
        return V4Cache.empty(self.config, weight.dtype, weight.device)

    def forward(self, input_ids: torch.Tensor, cache: V4Cache) -> torch.Tensor:
        """Logits ``[T, vocab]`` (fp32) of one request's next ``input_ids [T]`` (positions
        ``cache.num_tokens ...``); the tokens are appended to ``cache``. Prefill in chunks of
        any size, then decode with T = 1, give the same logits as one whole-prompt call."""
        return self.forward_batch(input_ids, [cache], [input_ids.shape[0]])

    @torch.no_grad()
    def forward_batch(self, input_ids: torch.Tensor, caches: list[V4Cache],
                      lengths: list[int]) -> torch.Tensor:
        """Several requests in one step: ``input_ids [T]`` holds ``lengths[r]`` tokens of
        request r (a prefill chunk or one decode token) after each other; logits ``[T, vocab]``.
        Per-token work (projections, mHC, MoE, head) runs on all T tokens at once; attention
        runs per request over its own cache."""
        device = input_ids.device
        for cache, n in zip(caches, lengths, strict=True):
            cache.reserve(cache.num_tokens + n)
        positions = torch.cat([torch.arange(n, device=device) + c.num_tokens
                               for c, n in zip(caches, lengths, strict=True)])
        x = self.model.embed(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.model.layers):
            streams = layer(streams, input_ids, positions, [c.layers[i] for c in caches],
                            lengths, self.rotary[layer.rope_kind])
        for cache, n in zip(caches, lengths, strict=True):
            cache.advance(n)
        hidden = self.model.norm(self.model.hc_head(streams))
        return self.tp.all_gather(self.lm_head(hidden).float())

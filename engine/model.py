"""DeepSeek-V2/V3 decoder for serving: embed -> layers (MLA + dense/MoE MLP) -> norm -> lm_head.

Parameter names equal the HF checkpoint's (``model.layers.{i}.self_attn.kv_b_proj.weight``...),
so the loader maps names one to one. TP layout (:mod:`engine.layout`, applied from outside:
:func:`build_model` builds the modules with :class:`TPLayout`'s local sizes, the loader fills
them with the slices the layout's rules name): attention heads and MLP/expert intermediate
dims are split, and each decoder layer all-reduces twice (after attention's o_proj and after
the MLP/MoE). ``embed_tokens`` and ``lm_head`` are REPLICATED on every TP rank (simple, costs
vocab x hidden per rank; vocab-parallel is a later optimization).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import MLAttention
from engine.forward_context import AttentionMetadata
from engine.kernels import KernelSet
from engine.kv_cache import KVCache
from engine.layout import TPLayout, tp_layout
from engine.model_config import ModelConfig
from engine.moe import MLP, MoE, MoEGate
from engine.norm import RMSNorm
from engine.parallel import TPGroup
from engine.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, config: ModelConfig, layer_idx: int, layout: TPLayout, tp: TPGroup,
                 kernels: KernelSet) -> None:
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layout.num_attention_heads, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config, layout.moe_intermediate_size) if config.is_moe_layer(layer_idx) \
            else MLP(config.hidden_size, layout.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, caches: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``; writes this layer's KV of the T tokens
        (``caches``: ``KVCache.layer_buffers(i)``)."""
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta, caches)
        h = x + self.tp.all_reduce(attn)
        return h + self.tp.all_reduce(self.mlp(self.post_attention_layernorm(h)))


class DeepseekModel(nn.Module):
    """The ``model.*`` part of the checkpoint."""

    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup,
                 kernels: KernelSet) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, layout, tp, kernels)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """Full model; :meth:`forward` runs one step and returns last-token logits.

    Args:
        config: model config. layout: this rank's local sizes. tp: this rank's TP group.
        kernels: resolved :class:`KernelSet`.
    """

    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup,
                 kernels: KernelSet) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config, layout, tp, kernels)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """One step.

        Args:
            input_ids: ``[T]`` int64 flattened tokens of the step.
            meta: the step's :class:`AttentionMetadata`.
            kv_cache: this rank's caches (layer i uses ``kv_cache.layer_buffers(i)``).

        Returns:
            ``[B, vocab]`` fp32 logits at each sequence's last token.
        """
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)  # [T, R/2]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, meta, kv_cache.layer_buffers(i))
        x = self.model.norm(x[meta.logits_index])  # [B, hidden]
        return self.lm_head(x).float()


def build_model(config: ModelConfig, tp: TPGroup, kernels: KernelSet, dtype: torch.dtype,
                device: torch.device) -> DeepseekForCausalLM:
    """An UNINITIALIZED model (storage allocated, values garbage) for the loader to fill, with
    rank ``tp.rank``'s share of every split weight (:func:`engine.layout.tp_layout`).

    Built on the meta device and materialized once, so no time goes into random init. The
    router's ``e_score_correction_bias`` stays fp32 whatever ``dtype`` is (selection is
    sensitive to it; HF keeps it fp32 too).

    Raises:
        ValueError: ``tp.size`` does not divide a size the layout splits (from ``tp_layout``).
    """
    layout = tp_layout(config, tp.size)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, layout, tp, kernels)
    model = model.to(dtype)
    for module in model.modules():
        if isinstance(module, MoEGate) and module.e_score_correction_bias is not None:
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    model = model.to_empty(device=device)
    model.rotary = RotaryEmbedding(config).to(device)  # its buffer was made on meta
    return model.eval()

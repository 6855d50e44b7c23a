"""The weight rows of the memory plan: elements of each weight kind one rank holds.

Split rules are the engine's one table (engine/layout.py ``RULES``): each row lists its
checkpoint weights with full shapes, and one rank's elements are
:meth:`engine.layout.ShardRule.local_shape` under the role's :func:`engine.layout.tp_layout`
(:func:`.role_layout.rank_layout`). Nothing is instantiated, no weights read. V3.2 indexer
weights appear only for sparse-attention models; under CP layer sharding a rank counts only
the layers it owns (``ceil(layers / cp)`` on CP rank 0) plus a prefetch pool of
:data:`PREFETCH_POOL` layers.

Every row function maps (model, layout) to (elements per rank, how they are split, in
words); :data:`.memory_plan.KINDS` gives each its storage class.
"""

from __future__ import annotations

import math

from engine.layout import linear_shape, rule_for
from engine.model_config import ModelConfig
from orchestrator.config.role_layout import RoleLayout, rank_layout

# NOTE: buffer sets of the layer-sharding prefetcher (engine LayerPrefetcher's pool_size).
PREFETCH_POOL = 2
_LAYER = "model.layers.0."  # decoder weights are named as layer 0's: the rules match any layer


def num_moe_layers(m: ModelConfig) -> int:
    """Decoder layers with routed experts (the rest have a dense MLP; DeepSeek-V4's
    ``V4Config.is_moe_layer`` says every layer routes)."""
    return sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))


def _held(m: ModelConfig, lay: RoleLayout, name: str, shape: tuple[int, ...]) -> int:
    """Elements one rank holds of checkpoint weight ``name`` of full ``shape``: what its rule
    in engine/layout.py leaves of it under the role's layout."""
    return math.prod(rule_for(name).local_shape(shape, rank_layout(m, lay)))


def _attention_linears(m: ModelConfig, lay: RoleLayout) -> dict[str, int]:
    """Elements of one layer's attention linears on one rank, by linear name."""
    q = ("q_a_proj", "q_b_proj") if m.q_lora_rank else ("q_proj",)  # plain q_proj: V2-Lite
    return {name: _held(m, lay, f"{_LAYER}self_attn.{name}.weight", linear_shape(m, name))
            for name in q + ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")}


def _mlp(m: ModelConfig, lay: RoleLayout, prefix: str, width: int) -> int:
    """Elements of one gate/up/down MLP of intermediate ``width`` (weights ``prefix*``) on one
    rank."""
    h = m.hidden_size
    return sum(_held(m, lay, f"{prefix}{name}.weight", shape) for name, shape in
               (("gate_proj", (width, h)), ("up_proj", (width, h)), ("down_proj", (h, width))))


def _layers_held(m: ModelConfig, lay: RoleLayout, name: str) -> int:
    """Layers of ``name`` one rank stores: all, or with layer sharding the most one CP rank
    owns (layer i lives on CP rank i % cp)."""
    layers = m.num_hidden_layers
    return -(-layers // lay.cp) if name in lay.layer_sharding else layers


def _sharded_text(m: ModelConfig, lay: RoleLayout, names: list[str]) -> str:
    sharded = [n for n in lay.layer_sharding if n in names]
    if not sharded:
        return ""
    return (f"; {', '.join(sharded)} layer-sharded: {_layers_held(m, lay, sharded[0])} of "
            f"{m.num_hidden_layers} layers (cp {lay.cp})")


def attention(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The attention linears but kv_b_proj, every layer the rank stores."""
    sizes = _attention_linears(m, lay)
    names = [n for n in sizes if n != "kv_b_proj"]
    # NOTE: cp > 1 has tp 1: attention replicated on every CP rank unless layer-sharded.
    return (sum(_layers_held(m, lay, n) * sizes[n] for n in names),
            f"q/o by heads /{lay.tp}; q_a, kv_a whole" + _sharded_text(m, lay, names))


def attention_kv_b(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """kv_b_proj, every layer the rank stores."""
    # NOTE: its own row because the engine keeps kv_b_proj at model precision even in a
    # quantized checkpoint (attention absorbs its weight into q and the output directly).
    held = _layers_held(m, lay, "kv_b_proj")
    return (held * _attention_linears(m, lay)["kv_b_proj"],
            f"by heads /{lay.tp}" + _sharded_text(m, lay, ["kv_b_proj"]))


def prefetch_pool(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The layer-sharding prefetcher's buffers: :data:`PREFETCH_POOL` layers of the
    layer-sharded linears."""
    sizes = _attention_linears(m, lay)
    per_layer = sum(sizes[n] for n in lay.layer_sharding if n in sizes)
    return PREFETCH_POOL * per_layer, f"{PREFETCH_POOL} layers of the layer-sharded weights"


def dense_mlp(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The MLPs of the layers without routed experts, intermediate split over TP."""
    dense = m.num_hidden_layers - num_moe_layers(m)
    return dense * _mlp(m, lay, f"{_LAYER}mlp.", m.intermediate_size), \
        f"{dense} layers, intermediate /{lay.tp}"


def shared_experts(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The shared experts of every MoE layer, intermediate split over TP."""
    width = m.n_shared_experts * m.moe_intermediate_size
    return num_moe_layers(m) * _mlp(m, lay, f"{_LAYER}mlp.shared_experts.", width), \
        f"intermediate /{lay.tp}"


def routed_experts(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The routed experts of every MoE layer: the rank's EP share whole, else all of them
    with the intermediate split over TP."""
    # NOTE: under EP, dp x tp divides the experts: load_config ran the engine's one check
    # (orchestrator/config/layout_check.py -> engine.layout.tp_layout) before any plan.
    experts, mine = m.n_routed_experts or 0, len(rank_layout(m, lay).experts)
    one = _mlp(m, lay, f"{_LAYER}mlp.experts.0.", m.moe_intermediate_size)
    split = f"{mine} of {experts} whole (EP {lay.ep_size})" if lay.ep else \
        f"all {experts}, intermediate /{lay.tp}"
    return num_moe_layers(m) * mine * one, split


def embedding(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The token embedding [vocab, hidden], vocabulary split over TP."""
    shape = (m.vocab_size, m.hidden_size)
    return _held(m, lay, "model.embed_tokens.weight", shape), f"vocab /{lay.tp}"


def lm_head(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The output head [vocab, hidden], vocabulary split over TP (0 when tied)."""
    if m.tie_word_embeddings:
        return 0, "tied to the embedding"
    return _held(m, lay, "lm_head.weight", (m.vocab_size, m.hidden_size)), f"vocab /{lay.tp}"


def _indexer_layer(m: ModelConfig, lay: RoleLayout) -> int:
    """Elements of one layer's lightning indexer linears (0 without DSA)."""
    if not m.uses_sparse_attention:
        return 0
    heads, dim, h = m.index_n_heads, m.index_head_dim, m.hidden_size
    shapes = {"wq_b": (heads * dim, m.q_lora_rank), "wk": (dim, h), "weights_proj": (heads, h)}
    return sum(_held(m, lay, f"{_LAYER}self_attn.indexer.{name}.weight", shape)
               for name, shape in shapes.items())


def indexer(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """DeepSeek-V3.2's lightning indexer linears, whole on every TP rank."""
    layers = sum(m.indexer_layers)  # NOTE: GLM-5.2's shared layers have no indexer
    return layers * _indexer_layer(m, lay), f"whole (every TP rank), {layers} layers"


def norms_and_gate(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """Every RMSNorm (and the indexer's k_norm weight and bias) and the MoE router gate."""
    h, experts = m.hidden_size, m.n_routed_experts or 0
    layer = {"input_layernorm.weight": h, "post_attention_layernorm.weight": h,
             "self_attn.kv_a_layernorm.weight": m.kv_lora_rank}
    if m.q_lora_rank:
        layer["self_attn.q_a_layernorm.weight"] = m.q_lora_rank
    k_norm = 2 * _held(m, lay, _LAYER + "self_attn.indexer.k_norm.weight",
                       (m.index_head_dim,)) if m.index_head_dim else 0  # weight and bias
    gate = {"mlp.gate.weight": (experts, h)}
    if m.topk_method == "noaux_tc":
        gate["mlp.gate.e_score_correction_bias"] = (experts,)
    norms = sum(_held(m, lay, _LAYER + name, (n,)) for name, n in layer.items())
    router = sum(_held(m, lay, _LAYER + name, shape) for name, shape in gate.items())
    final = _held(m, lay, "model.norm.weight", (h,))
    return m.num_hidden_layers * norms + sum(m.indexer_layers) * k_norm + final \
        + num_moe_layers(m) * router, "whole"


def mtp_module(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The MTP module: one decoder layer (index ``num_hidden_layers``) + eh_proj + 3 norms."""
    if not lay.mtp:
        return 0, ""
    n, h = m.num_hidden_layers, m.hidden_size
    layer = sum(_attention_linears(m, lay).values())
    if m.is_moe_layer(n):
        width = m.n_shared_experts * m.moe_intermediate_size
        layer += _mlp(m, lay, f"{_LAYER}mlp.shared_experts.", width) \
            + len(rank_layout(m, lay).experts) \
            * _mlp(m, lay, f"{_LAYER}mlp.experts.0.", m.moe_intermediate_size) \
            + (m.n_routed_experts or 0) * (h + int(m.topk_method == "noaux_tc"))
    else:
        layer += _mlp(m, lay, f"{_LAYER}mlp.", m.intermediate_size)
    # NOTE: under DSA the MTP layer has its own indexer (linears + k_norm weight and bias)
    layer += _indexer_layer(m, lay) + (2 * m.index_head_dim if m.uses_sparse_attention else 0)
    return layer + 2 * h * h + 5 * h + m.kv_lora_rank + (m.q_lora_rank or 0), \
        "one decoder layer + eh_proj [h, 2h] + norms"

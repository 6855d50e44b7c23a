"""The KV rows of the memory plan: elements of each KV cache buffer one rank holds.

The rows count the model's per-layer specs (:func:`engine.kv_layer_spec.mla_layer_specs`,
what the engine's cache allocates) over the token slots of the pool
:func:`engine.pool_plan.plan_pools` sizes from them (as it sizes DeepSeek-V4's group pools).
Every TP rank of a DP rank holds the whole cache. Each row function maps (model, layout) to
(elements per rank, how they are split, in words).
"""

from __future__ import annotations

from engine.kv_groups import KV
from engine.kv_layer_spec import MLA_INDEXER, MLALayerSpec, held_elements, mla_layer_specs
from engine.model_config import ModelConfig
from engine.pool_plan import plan_pools
from orchestrator.config.role_layout import RoleLayout


def _kv_layers(m: ModelConfig, lay: RoleLayout) -> tuple[MLALayerSpec, ...]:
    """What the rank's runner caches: the decoder layers' specs, then the MTP layer's."""
    return mla_layer_specs(m, mtp_layers=int(lay.mtp))


def _kv_pool(m: ModelConfig, lay: RoleLayout) -> tuple[int, int]:
    """(blocks, token slots per block) of the rank's KV pool: the ``kv`` group of
    :func:`engine.pool_plan.plan_pools` over the layer specs, as engine/runner.py sizes it."""
    plan = plan_pools(_kv_layers(m, lay), lay.num_kv_blocks, lay.block_size, None)
    return plan.blocks[KV], plan.block_sizes[KV]


def _kv_held(m: ModelConfig, lay: RoleLayout, name: str) -> tuple[int, str]:
    """Elements of buffer ``name`` over the decoder layers' caches: the layer specs' rows
    (:func:`engine.kv_layer_spec.mla_layer_specs`) of the pool's ``blocks x block_size``
    token slots (an MLA tensor has one row per token slot, every layer with it), and the
    split text ``blocks x block_size x width``."""
    blocks, size = _kv_pool(m, lay)
    decoder = _kv_layers(m, lay)[:m.num_hidden_layers]
    width = next(t.width for s in decoder for t in s.tensors() if t.name == name)
    return held_elements(decoder, blocks * size, names=(name,)), \
        f"{blocks} blocks x {size} x {width}"


def kv_latent(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The compressed KV latent c_kv [slots, kv_lora_rank] of every decoder layer."""
    return _kv_held(m, lay, "k")


def kv_rope(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The decoupled RoPE key k_pe [slots, qk_rope_head_dim] of every decoder layer."""
    return _kv_held(m, lay, "v")


def kv_index(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """DeepSeek-V3.2's indexer keys index_k [slots, index_head_dim] of its indexer layers."""
    # NOTE: GLM-5.2's shared layers have no index_k
    layers = sum(s.kind == MLA_INDEXER for s in mla_layer_specs(m))
    elements, split = _kv_held(m, lay, "index_k")
    return elements, f"{split}, {layers} layers"


def kv_mtp(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The MTP layer's cache (speculative decoding; 0 without it)."""
    if not lay.mtp:
        return 0, ""
    mtp = _kv_layers(m, lay)[m.num_hidden_layers:]  # NOTE: DSA: it has index_k
    blocks, size = _kv_pool(m, lay)
    return held_elements(mtp, blocks * size), \
        "c_kv + k_pe" + (" + index_k" if mtp[0].index_head_dim else "") + " of the MTP layer"

"""Per-rank memory plan: what one rank of a role holds, by kind, from config.json and the layout.

The plan is a table: one :class:`Kind` per row (:data:`KINDS`) giving the ELEMENTS one rank
holds (a pure function of the :class:`engine.model_config.ModelConfig` and the
:class:`RoleLayout`) and its storage class; :class:`Precision` gives bytes per element
(quantized ``linear`` weights: :func:`engine.quant.memory.bytes_per_param`; ``kv_b_proj``,
dequantized at load, stays ``weight``). Nothing is instantiated, no weights read. Split rules
are the engine's one table (engine/layout.py ``RULES``): each weight row lists its checkpoint
weights with full shapes, and one rank's elements are
:meth:`engine.layout.ShardRule.local_shape` under the role's :func:`engine.layout.tp_layout`.
The KV rows count the model's per-layer specs (:func:`engine.kv_layer_spec.mla_layer_specs`,
what the engine's cache allocates) over the token slots of the pool
:func:`engine.pool_plan.plan_pools` sizes from them (as it sizes DeepSeek-V4's group pools).
V3.2 indexer rows appear only for sparse-attention models; under CP layer sharding a rank
counts only the layers it owns (``ceil(layers / cp)`` on CP rank 0) plus a prefetch pool of
:data:`PREFETCH_POOL` layers. Communicator buffers (device memory each NCCL/HCCL group holds
outside PyTorch's allocator) are one row: the rank's communicators x the backend's buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from engine.kv_groups import KV
from engine.kv_layer_spec import MLA_INDEXER, MLALayerSpec, held_elements, mla_layer_specs
from engine.layout import linear_shape
from engine.layout import TPLayout, rule_for, tp_layout
from engine.model_config import ModelConfig
from engine.pool_plan import plan_pools

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# NOTE: buffer sets of the layer-sharding prefetcher (engine LayerPrefetcher's pool_size).
PREFETCH_POOL = 2
_LAYER = "model.layers.0."  # decoder weights are named as layer 0's: the rules match any layer


@dataclass(frozen=True)
class RoleLayout:
    """One role's parallel layout and scheduler sizes (what the plan depends on).

    Attributes:
        role: "prefill", "decode" or "colocated".
        dp, tp: DP ranks of the role and TP ranks per DP rank.
        cp: context-parallel ranks per DP rank (prefill; tp is 1 then).
        layer_sharding: attention linears stored on one CP rank per layer (cp > 1).
        ep: routed experts split over all ``dp * tp`` ranks (else TP-sharded per DP rank).
        num_kv_blocks, block_size: the KV cache of one DP rank (every TP rank holds all of it).
        step_tokens: most tokens one step runs (prefill: max_num_batched_tokens; decode:
            max_num_seqs).
        max_num_seqs: most sequences one step samples (logits rows).
        max_model_len: longest sequence, tokens (the prefix chunked prefill decompresses).
        pair_groups: KV pair groups one rank of the role is in (0: colocated).
        pair_buffer_bytes: device memory one pair group holds (kv_transfer/backend.py
            ``COMM_SETTINGS``).
        comm_buffer_bytes: device memory one TP / EP / CP communicator holds (the backend's
            default there, or ``kv_transfer.comm_buffer_mb``).
        mtp: the ranks hold the checkpoint's MTP module and its KV cache (speculative
            decoding, ``decode.speculative``).
        staging_blocks: blocks of a DeepSeek-V4 PD rank's staging cache (its role's
            ``v4_staging_blocks``, else ``num_kv_blocks``; engine/v4/staging.py); 0 for
            colocated roles. Other models ignore it.
        chunk_size: most tokens one request writes per step (the scheduler's: prefill chunk,
            1 on decode): a DeepSeek-V4 window's span per request (engine/pool_plan.py).
            Other models ignore it.
    """

    role: str
    dp: int
    tp: int
    ep: bool
    num_kv_blocks: int
    block_size: int
    step_tokens: int
    max_num_seqs: int
    max_model_len: int
    cp: int = 1
    layer_sharding: tuple[str, ...] = ()
    pair_groups: int = 0
    pair_buffer_bytes: int = 0
    comm_buffer_bytes: int = 0
    mtp: bool = False
    staging_blocks: int = 0
    chunk_size: int = 1

    @property
    def collectives(self) -> tuple[str, ...]:
        """The rank's TP, EP and CP communicators (each when it spans more than one rank)."""
        return tuple(name for name, on in (("TP", self.tp > 1), ("EP", self.ep_size > 1),
                                           ("CP", self.cp > 1)) if on)

    @property
    def ranks(self) -> int:
        """Ranks of the role: ``dp * tp * cp``."""
        return self.dp * self.tp * self.cp

    @property
    def section(self) -> str:
        """The config section that sizes the role (colocated instances: ``decode``)."""
        return "decode" if self.role == "colocated" else self.role

    @property
    def ep_size(self) -> int:
        """Ranks the routed experts are split over (1: every DP rank holds all experts)."""
        return self.ranks if self.ep else 1


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each storage class.

    Attributes:
        linear: projection and expert weights (the ones a quantized checkpoint stores small).
        weight: embedding, lm_head, norms, router gate (kept at model precision).
        kv: KV cache elements.
        activation: workspace activations.
        fp32: float32 workspace (logits).
        byte: rows counted in bytes (communicator buffers).
    """

    linear: float
    weight: float
    kv: float
    activation: float
    fp32: float = 4.0
    byte: float = 1.0

    @classmethod
    def of(cls, dtype: str, linear: float | None = None) -> "Precision":
        """Everything at ``dtype`` ("bfloat16", "float16", "float32"), except ``linear``
        weights when given (bytes per element of a quantized checkpoint's linears)."""
        size = DTYPE_BYTES[dtype]
        return cls(linear=size if linear is None else linear, weight=size, kv=size,
                   activation=size)


@dataclass(frozen=True)
class Kind:
    """One row of the plan.

    Attributes:
        name: what the row holds ("routed experts").
        group: "weights", "kv", "workspace" or "communicators".
        storage: the :class:`Precision` field giving its bytes per element.
        count: (model, layout) -> (elements per rank, how they are split, in words).
        sparse_only: a DeepSeek-V3.2 (DSA) row, left out of other models' plans.
        layer_sharded_only: a layer-sharding row, left out of layouts without it.
        comm_only: a row left out when it counts no bytes (communicators, MTP).
    """

    name: str
    group: str
    storage: str
    count: Callable[[ModelConfig, RoleLayout], tuple[int, str]]
    sparse_only: bool = False
    layer_sharded_only: bool = False
    comm_only: bool = False


@dataclass(frozen=True)
class PlanRow:
    """A kind's share of one rank: ``elements`` x ``bytes_per_element`` bytes."""

    kind: str
    group: str
    elements: int
    bytes_per_element: float
    split: str

    @property
    def bytes(self) -> int:
        return math.ceil(self.elements * self.bytes_per_element)


@dataclass(frozen=True)
class RolePlan:
    """What ONE rank of a role holds (every rank of a role holds the same amount)."""

    layout: RoleLayout
    rows: tuple[PlanRow, ...]

    def bytes_of(self, group: str) -> int:
        """Bytes of the rows of ``group`` ("weights", "kv", "workspace", "communicators")."""
        return sum(row.bytes for row in self.rows if row.group == group)

    @property
    def total_bytes(self) -> int:
        return sum(row.bytes for row in self.rows)


def num_moe_layers(m: ModelConfig) -> int:
    """Decoder layers with routed experts (the rest have a dense MLP; DeepSeek-V4's
    ``V4Config.is_moe_layer`` says every layer routes)."""
    return sum(m.is_moe_layer(i) for i in range(m.num_hidden_layers))


def _tp(m: ModelConfig, lay: RoleLayout) -> TPLayout:
    """The engine's layout of one rank of the role (EP rank 0: every EP rank holds as many)."""
    return tp_layout(m, lay.tp, lay.ep_size)


def _held(m: ModelConfig, lay: RoleLayout, name: str, shape: tuple[int, ...]) -> int:
    """Elements one rank holds of checkpoint weight ``name`` of full ``shape``: what its rule
    in engine/layout.py leaves of it under the role's layout."""
    return math.prod(rule_for(name).local_shape(shape, _tp(m, lay)))


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


def _attention(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    sizes = _attention_linears(m, lay)
    names = [n for n in sizes if n != "kv_b_proj"]
    # NOTE: cp > 1 has tp 1: attention replicated on every CP rank unless layer-sharded.
    return (sum(_layers_held(m, lay, n) * sizes[n] for n in names),
            f"q/o by heads /{lay.tp}; q_a, kv_a whole" + _sharded_text(m, lay, names))


def _attention_kv_b(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    # NOTE: its own row because the engine keeps kv_b_proj at model precision even in a
    # quantized checkpoint (attention absorbs its weight into q and the output directly).
    held = _layers_held(m, lay, "kv_b_proj")
    return (held * _attention_linears(m, lay)["kv_b_proj"],
            f"by heads /{lay.tp}" + _sharded_text(m, lay, ["kv_b_proj"]))


def _prefetch_pool(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    sizes = _attention_linears(m, lay)
    per_layer = sum(sizes[n] for n in lay.layer_sharding if n in sizes)
    return PREFETCH_POOL * per_layer, f"{PREFETCH_POOL} layers of the layer-sharded weights"


def _dense_mlp(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    dense = m.num_hidden_layers - num_moe_layers(m)
    return dense * _mlp(m, lay, f"{_LAYER}mlp.", m.intermediate_size), \
        f"{dense} layers, intermediate /{lay.tp}"


def _shared_experts(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    width = m.n_shared_experts * m.moe_intermediate_size
    return num_moe_layers(m) * _mlp(m, lay, f"{_LAYER}mlp.shared_experts.", width), \
        f"intermediate /{lay.tp}"


def _routed_experts(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    # NOTE: under EP, dp x tp divides the experts: load_config ran the engine's one check
    # (orchestrator/config/layout_check.py -> engine.layout.tp_layout) before any plan.
    experts, mine = m.n_routed_experts or 0, len(_tp(m, lay).experts)
    one = _mlp(m, lay, f"{_LAYER}mlp.experts.0.", m.moe_intermediate_size)
    split = f"{mine} of {experts} whole (EP {lay.ep_size})" if lay.ep else \
        f"all {experts}, intermediate /{lay.tp}"
    return num_moe_layers(m) * mine * one, split


def _embedding(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    shape = (m.vocab_size, m.hidden_size)
    return _held(m, lay, "model.embed_tokens.weight", shape), f"vocab /{lay.tp}"


def _lm_head(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
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


def _indexer(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    layers = sum(m.indexer_layers)  # NOTE: GLM-5.2's shared layers have no indexer
    return layers * _indexer_layer(m, lay), f"whole (every TP rank), {layers} layers"


def _norms_and_gate(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
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


def _kv_latent(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    return _kv_held(m, lay, "k")


def _kv_rope(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    return _kv_held(m, lay, "v")


def _kv_index(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    # NOTE: GLM-5.2's shared layers have no index_k
    layers = sum(s.kind == MLA_INDEXER for s in mla_layer_specs(m))
    elements, split = _kv_held(m, lay, "index_k")
    return elements, f"{split}, {layers} layers"


def _activations(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    # NOTE: an estimate of the live tensors of one layer (they are reused layer to layer),
    # assuming fused (flash / paged) attention kernels that never hold a score matrix:
    # per step token: 4 hidden-wide tensors (residual, normed input, attention and MLP out),
    # the q and kv latents, MHA-form q, k, v and output on local heads, and per routed
    # expert choice its dispatched copy in and out plus gate, up and SwiGLU intermediates;
    # chunked prefill also decompresses the cached prefix (max_model_len tokens) on local
    # heads.
    local = _tp(m, lay)
    heads, inter = local.num_attention_heads, local.expert_intermediate_size
    per_token = 4 * m.hidden_size + (m.q_lora_rank or 0) + m.kv_lora_rank \
        + m.qk_rope_head_dim + heads * 2 * (m.qk_head_dim + m.v_head_dim) \
        + m.num_experts_per_tok * (2 * m.hidden_size + 3 * inter)
    prefix = 0 if lay.role == "decode" else \
        lay.max_model_len * heads * (m.qk_nope_head_dim + m.v_head_dim)
    mine = -(-lay.step_tokens // lay.cp)  # NOTE: CP: each rank computes 1/cp of a step
    cp = f" / cp {lay.cp}" if lay.cp > 1 else ""
    return mine * per_token + prefix, f"{lay.step_tokens} step tokens{cp} (estimate)"


def _logits(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    return lay.max_num_seqs * m.vocab_size, f"{lay.max_num_seqs} seqs x full vocab, fp32"


def _pair_buffers(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    return lay.pair_groups * lay.pair_buffer_bytes, \
        f"{lay.pair_groups} KV pair group(s) x {lay.pair_buffer_bytes / 1e6:g} MB"


def _collective_buffers(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    names = lay.collectives
    return len(names) * lay.comm_buffer_bytes, \
        f"{' + '.join(names) or 'none'} x {lay.comm_buffer_bytes / 1e6:g} MB"


def _mtp_module(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The MTP module: one decoder layer (index ``num_hidden_layers``) + eh_proj + 3 norms."""
    if not lay.mtp:
        return 0, ""
    n, h = m.num_hidden_layers, m.hidden_size
    layer = sum(_attention_linears(m, lay).values())
    if m.is_moe_layer(n):
        width = m.n_shared_experts * m.moe_intermediate_size
        layer += _mlp(m, lay, f"{_LAYER}mlp.shared_experts.", width) + len(_tp(m, lay).experts) \
            * _mlp(m, lay, f"{_LAYER}mlp.experts.0.", m.moe_intermediate_size) \
            + (m.n_routed_experts or 0) * (h + int(m.topk_method == "noaux_tc"))
    else:
        layer += _mlp(m, lay, f"{_LAYER}mlp.", m.intermediate_size)
    # NOTE: under DSA the MTP layer has its own indexer (linears + k_norm weight and bias)
    layer += _indexer_layer(m, lay) + (2 * m.index_head_dim if m.uses_sparse_attention else 0)
    return layer + 2 * h * h + 5 * h + m.kv_lora_rank + (m.q_lora_rank or 0), \
        "one decoder layer + eh_proj [h, 2h] + norms"


def _kv_mtp(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    if not lay.mtp:
        return 0, ""
    mtp = _kv_layers(m, lay)[m.num_hidden_layers:]  # NOTE: DSA: it has index_k
    blocks, size = _kv_pool(m, lay)
    return held_elements(mtp, blocks * size), \
        "c_kv + k_pe" + (" + index_k" if mtp[0].index_head_dim else "") + " of the MTP layer"


KINDS: tuple[Kind, ...] = (
    Kind("attention", "weights", "linear", _attention),
    Kind("attention: kv_b_proj", "weights", "weight", _attention_kv_b),
    Kind("dense MLP", "weights", "linear", _dense_mlp),
    Kind("shared experts", "weights", "linear", _shared_experts),
    Kind("routed experts", "weights", "linear", _routed_experts),
    Kind("embedding", "weights", "weight", _embedding),
    Kind("lm_head", "weights", "weight", _lm_head),
    Kind("indexer (V3.2)", "weights", "linear", _indexer, sparse_only=True),
    Kind("norms + router gate", "weights", "weight", _norms_and_gate),
    Kind("layer-sharding prefetch", "workspace", "weight", _prefetch_pool,
         layer_sharded_only=True),
    Kind("KV cache: c_kv latent", "kv", "kv", _kv_latent),
    Kind("KV cache: k_pe", "kv", "kv", _kv_rope),
    Kind("KV cache: index_k", "kv", "kv", _kv_index, sparse_only=True),
    Kind("MTP module (speculative)", "weights", "linear", _mtp_module, comm_only=True),
    Kind("KV cache: MTP layer", "kv", "kv", _kv_mtp, comm_only=True),
    Kind("workspace: activations", "workspace", "activation", _activations),
    Kind("workspace: logits", "workspace", "fp32", _logits),
    Kind("comm: KV pair groups", "communicators", "byte", _pair_buffers, comm_only=True),
    Kind("comm: TP/EP/CP groups", "communicators", "byte", _collective_buffers,
         comm_only=True),
)


def plan_role(model: ModelConfig, layout: RoleLayout, precision: Precision) -> RolePlan:
    """The memory of one rank of ``layout``'s role, one row per :data:`KINDS` entry.

    Raises:
        ValueError: ``layout`` is not one the engine can build
            (:func:`engine.layout.tp_layout`'s error).
    """
    rows = []
    for kind in KINDS:
        if kind.sparse_only and not model.uses_sparse_attention:
            continue
        if kind.layer_sharded_only and not layout.layer_sharding:
            continue
        elements, split = kind.count(model, layout)
        if kind.comm_only and not elements:
            continue
        rows.append(PlanRow(kind.name, kind.group, elements,
                            getattr(precision, kind.storage), split))
    return RolePlan(layout, tuple(rows))

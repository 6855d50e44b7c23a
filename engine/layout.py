"""Parallel layout of the model's weights (TP, vocab-parallel, expert-parallel), in one place.

Model modules take their local sizes as ints and never split anything. :data:`RULES` (full
match on the parameter name) says how each checkpoint parameter is split over the TP group or
owned by one EP rank, and which ``config.json`` size the TP size must divide so heads and
intermediate channels stay whole; :func:`tp_layout` checks that once and gives the local
sizes (:class:`TPLayout`); :meth:`ShardRule.local_slices` / :meth:`ShardRule.local_shape`
give the loader's slice and the memory plan's shape.

===========================================  ==============  =====================
parameter (``L.`` = ``model.layers.{i}.``)   split           TP size must divide
===========================================  ==============  =====================
``model.embed_tokens``, ``lm_head``          vocab (dim 0)   - (last shard padded)
every norm, ``q_a_proj``, ``kv_a_proj...``   replicated      -
MTP ``L.{enorm,hnorm,eh_proj,shared_head}``  replicated      -
``L.self_attn.{q_proj,q_b_proj,kv_b_proj}``  column (dim 0)  num_attention_heads
``L.self_attn.o_proj``                       row (dim 1)     num_attention_heads
``L.self_attn.indexer.*`` (V3.2)             replicated      -
``L.mlp.{gate,up}_proj`` (dense layers)      column (dim 0)  intermediate_size
``L.mlp.down_proj`` (dense layers)           row (dim 1)     intermediate_size
``L.mlp.gate`` (router weight and bias)      replicated      -
``L.mlp.experts.{j}.{gate,up}_proj``         column / EP     moe_intermediate_size
``L.mlp.experts.{j}.down_proj``              row / EP        moe_intermediate_size
``L.mlp.shared_experts.{gate,up}_proj``      column (dim 0)  moe_intermediate_size
``L.mlp.shared_experts.down_proj``           row (dim 1)     moe_intermediate_size
===========================================  ==============  =====================

Dims are those of an ``nn.Linear`` weight ``[out, in]``; attention's split dims are head-major
(``[H * D]``). NOTE: a row-parallel output is a PARTIAL sum: each decoder layer all-reduces
after ``o_proj`` and after the MLP/MoE (routed + shared summed first). Vocab-parallel: rank
``r`` holds rows ``r*n .. r*n+n-1`` with ``n = ceil(vocab_size / tp)``, the last shard
zero-padded (as vLLM); the embedding all-reduces, lm_head all-gathers and trims to
``vocab_size``. Under EP (``ep > 1``, over all dp x tp ranks of a role) routed expert ``j`` is
whole on EP rank ``j // (n_routed_experts / ep)`` only (:attr:`TPLayout.experts`); shared
experts keep their TP rules. Context parallel (tp = 1) replicates every weight; layer
sharding (:mod:`engine.layer_sharding`) is an ownership policy on top, not a split.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

from engine.model_config import ModelConfig


class Split(Enum):
    """How a weight ``[out, in]`` is split over the TP group."""

    REPLICATED = "replicated"  # whole tensor on every rank
    COLUMN = "column"  # output features (dim 0) in tp contiguous parts
    ROW = "row"  # input features (dim 1) in tp contiguous parts
    VOCAB = "vocab"  # dim 0 in tp parts of ceil(vocab_size / tp) rows, last one padded

    @property
    def dim(self) -> int | None:
        """The split dim, or None (replicated)."""
        return {"column": 0, "row": 1, "vocab": 0}.get(self.value)


@dataclass(frozen=True)
class TPLayout:
    """One rank's share of every config size the layout splits.

    Attributes:
        num_attention_heads: attention heads of this rank.
        intermediate_size: dense MLP intermediate channels of this rank.
        moe_intermediate_size: per-expert intermediate channels of this rank's shared
            experts (they are ``n_shared_experts`` times this wide); TP-split.
        expert_intermediate_size: intermediate channels of each routed expert on this rank:
            TP-split without EP, the full ``moe_intermediate_size`` under EP.
        vocab_size: rows of ``embed_tokens`` / ``lm_head`` on this rank (padded part).
        experts: ids of the routed experts this rank holds (all without EP; empty for a
            dense model).
        tp_size: TP ranks. ep_size: EP ranks (1: EP off). full_vocab_size: config vocab.
    """

    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    expert_intermediate_size: int
    vocab_size: int
    experts: range
    tp_size: int
    ep_size: int
    full_vocab_size: int


@dataclass(frozen=True)
class ShardRule:
    """The layout of every parameter whose name fully matches ``pattern``.

    Attributes:
        pattern: regular expression, full match on the parameter (= checkpoint) name.
        split: how the tensor is split over the TP group.
        unit: for COLUMN / ROW splits, the :class:`ModelConfig` field the TP size must divide
            (so the split keeps heads / intermediate channels whole); else None.
        expert: a routed-expert weight: whole on its one EP owner under EP (``split`` applies
            only without EP).
    """

    pattern: str
    split: Split
    unit: str | None = None
    expert: bool = False

    def split_in(self, layout: TPLayout) -> Split:
        """The split this rule uses under ``layout`` (REPLICATED over TP for an expert
        weight under EP: the EP owner holds it whole)."""
        return Split.REPLICATED if self.expert and layout.ep_size > 1 else self.split

    def local_slices(self, full_shape: tuple[int, ...], tp_rank: int,
                     layout: TPLayout) -> tuple[slice, ...]:
        """Index of TP rank ``tp_rank``'s shard in the full tensor (everything when
        replicated). For VOCAB the last rank's slice may be shorter than its parameter
        (the rest is padding)."""
        split, index = self.split_in(layout), [slice(None)] * len(full_shape)
        dim = split.dim
        if dim is not None and layout.tp_size > 1:
            n = layout.vocab_size if split is Split.VOCAB else full_shape[dim] // layout.tp_size
            index[dim] = slice(min(tp_rank * n, full_shape[dim]),
                               min((tp_rank + 1) * n, full_shape[dim]))
        return tuple(index)

    def local_shape(self, full_shape: tuple[int, ...], layout: TPLayout) -> tuple[int, ...]:
        """The shape of the parameter on one rank, from its checkpoint shape (the inverse of
        :meth:`full_shape`): the split dim divided by the TP size, ``ceil(vocab_size / tp)``
        rows for VOCAB (padding included), whole when replicated."""
        split, shape = self.split_in(layout), list(full_shape)
        if split is Split.VOCAB:
            shape[0] = layout.vocab_size
        elif split.dim is not None:
            shape[split.dim] //= layout.tp_size
        return tuple(shape)

    def full_shape(self, local_shape: tuple[int, ...], layout: TPLayout) -> tuple[int, ...]:
        """The checkpoint (unsplit) shape of a parameter whose local shape is ``local_shape``."""
        split, shape = self.split_in(layout), list(local_shape)
        if split is Split.VOCAB:
            shape[0] = layout.full_vocab_size
        elif split.dim is not None:
            shape[split.dim] *= layout.tp_size
        return tuple(shape)


_L = r"model\.layers\.\d+\."
REPLICATED, COLUMN, ROW, VOCAB = Split.REPLICATED, Split.COLUMN, Split.ROW, Split.VOCAB
_HEADS, _INTER, _MOE_INTER = "num_attention_heads", "intermediate_size", "moe_intermediate_size"

RULES: tuple[ShardRule, ...] = (
    ShardRule(r"model\.embed_tokens\.weight", VOCAB),
    ShardRule(_L + r"(input|post_attention)_layernorm\.weight", REPLICATED),
    ShardRule(_L + r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight", REPLICATED),
    ShardRule(_L + r"self_attn\.(q_a|kv_a)_layernorm\.weight", REPLICATED),
    ShardRule(_L + r"self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight", COLUMN, _HEADS),
    ShardRule(_L + r"self_attn\.o_proj\.weight", ROW, _HEADS),
    ShardRule(_L + r"self_attn\.indexer\.(wq_b|wk|weights_proj|k_norm)\.weight", REPLICATED),
    ShardRule(_L + r"self_attn\.indexer\.k_norm\.bias", REPLICATED),
    ShardRule(_L + r"mlp\.(gate_proj|up_proj)\.weight", COLUMN, _INTER),
    ShardRule(_L + r"mlp\.down_proj\.weight", ROW, _INTER),
    ShardRule(_L + r"mlp\.gate\.(weight|e_score_correction_bias)", REPLICATED),
    ShardRule(_L + r"mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight", COLUMN, _MOE_INTER,
              expert=True),
    ShardRule(_L + r"mlp\.experts\.\d+\.down_proj\.weight", ROW, _MOE_INTER, expert=True),
    ShardRule(_L + r"mlp\.shared_experts\.(gate_proj|up_proj)\.weight", COLUMN, _MOE_INTER),
    ShardRule(_L + r"mlp\.shared_experts\.down_proj\.weight", ROW, _MOE_INTER),
    ShardRule(r"model\.norm\.weight", REPLICATED),
    ShardRule(r"lm_head\.weight", VOCAB),
    ShardRule(_L + r"(enorm|hnorm|eh_proj|shared_head\.norm)\.weight", REPLICATED),  # MTP
)

_COMPILED = tuple((re.compile(rule.pattern), rule) for rule in RULES)


def rule_for(name: str) -> ShardRule:
    """The one rule of :data:`RULES` that parameter ``name`` fully matches.

    Raises:
        LookupError: no rule or several rules match (a new parameter needs exactly one row
            in :data:`RULES`).
    """
    found = [rule for pattern, rule in _COMPILED if pattern.fullmatch(name)]
    if len(found) != 1:
        raise LookupError(f"parameter {name} matches {len(found)} rules of engine/layout.py "
                          f"RULES ({[r.pattern for r in found]}); give it exactly one")
    return found[0]


SPLIT_UNITS: tuple[str, ...] = tuple(dict.fromkeys(r.unit for r in RULES if r.unit))
"""The config sizes the TP size must divide, each named once."""


def tp_layout(config: ModelConfig, tp_size: int, ep_size: int = 1,
              ep_rank: int = 0) -> TPLayout:
    """Local sizes of ``config`` under TP ``tp_size`` and EP ``ep_size`` (EP rank
    ``ep_rank``; 1 = EP off); the one divisibility check.

    Raises:
        ValueError: ``tp_size`` is not positive or does not divide a split size; ``ep_size``
            does not divide ``n_routed_experts`` or ``ep_rank`` is outside the group; the
            message names the field and the sizes that would work.
    """
    if tp_size < 1:
        raise ValueError(f"tp={tp_size}: the TP size must be at least 1")
    for unit in SPLIT_UNITS:
        full = getattr(config, unit)
        if full % tp_size:
            raise ValueError(f"tp={tp_size} does not divide {unit}={full} of the checkpoint's "
                             "config.json: use a tp that divides it (tp sizes that divide "
                             f"every split size: {_divisors(_common_unit(config))})")
    experts = expert_range(config, ep_size, ep_rank)
    moe = config.moe_intermediate_size
    vocab = -(-config.vocab_size // tp_size)
    return TPLayout(num_attention_heads=config.num_attention_heads // tp_size,
                    intermediate_size=config.intermediate_size // tp_size,
                    moe_intermediate_size=moe // tp_size,
                    expert_intermediate_size=moe if ep_size > 1 else moe // tp_size,
                    vocab_size=vocab, experts=experts, tp_size=tp_size, ep_size=ep_size,
                    full_vocab_size=config.vocab_size)


def expert_range(config: ModelConfig, ep_size: int, ep_rank: int) -> range:
    """The routed expert ids of EP rank ``ep_rank`` (see module doc): ``n / ep_size``
    consecutive ids from ``ep_rank * n / ep_size``, ``n = config.n_routed_experts`` (any
    config with that field: DeepSeek-V4's :mod:`engine.v4.expert_parallel` uses it too).

    Raises:
        ValueError: ``ep_rank`` outside the group; ``ep_size`` does not divide ``n`` (the
            message lists the sizes that would).
    """
    n = config.n_routed_experts or 0
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank {ep_rank} is outside an EP group of size {ep_size}")
    if n % ep_size:
        raise ValueError(
            f"the expert-parallel size dp*tp*cp={ep_size} does not divide n_routed_experts="
            f"{n} of the checkpoint's config.json: choose dp, tp and cp (prefill only) whose "
            f"product is one of {_divisors(n)}, or turn expert parallelism off")
    per_rank = n // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def _common_unit(config: ModelConfig) -> int:
    return math.gcd(*(getattr(config, unit) for unit in SPLIT_UNITS))


def _divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` (0 -> [])."""
    return [d for d in range(1, n + 1) if n % d == 0]


def linear_shape(config: ModelConfig, name: str) -> tuple[int, int]:
    """``[out, in]`` of attention linear ``name`` (:data:`SHARDABLE`) with all heads."""
    h, hidden, lat = config.num_attention_heads, config.hidden_size, config.kv_lora_rank
    return {"q_proj": (h * config.qk_head_dim, hidden),
            "q_a_proj": (config.q_lora_rank or 0, hidden),
            "q_b_proj": (h * config.qk_head_dim, config.q_lora_rank or 0),
            "kv_a_proj_with_mqa": (lat + config.qk_rope_head_dim, hidden),
            "kv_b_proj": (h * (config.qk_nope_head_dim + config.v_head_dim), lat),
            "o_proj": (hidden, h * config.v_head_dim)}[name]

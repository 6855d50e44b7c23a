"""Tensor-parallel layout of the model's weights, in one place.

The model code is plain: modules take their local sizes as ints and never split anything
themselves. This module decides, from one table, for every parameter of the checkpoint:

- how it is split over the TP group (:data:`RULES`, full match on the parameter name);
- which ``config.json`` size the TP size must divide for that split to keep whole units
  (heads for attention, so a head is never cut in two); checked once, in
  :func:`tp_layout`, whose error says what to change;
- the local sizes the modules are built with (:class:`TPLayout`), and the slice of the full
  checkpoint tensor the loader reads (:meth:`ShardRule.local_slices`).

===========================================  ==============  =====================
parameter (``L.`` = ``model.layers.{i}.``)   split           TP size must divide
===========================================  ==============  =====================
``model.embed_tokens``, ``lm_head``          replicated      -
every norm, ``q_a_proj``, ``kv_a_proj...``   replicated      -
``L.self_attn.{q_proj,q_b_proj,kv_b_proj}``  column (dim 0)  num_attention_heads
``L.self_attn.o_proj``                       row (dim 1)     num_attention_heads
``L.self_attn.indexer.*`` (V3.2)             replicated      -
``L.mlp.{gate,up}_proj`` (dense layers)      column (dim 0)  intermediate_size
``L.mlp.down_proj`` (dense layers)           row (dim 1)     intermediate_size
``L.mlp.gate`` (router weight and bias)      replicated      -
``L.mlp.experts.{j}.{gate,up}_proj``         column (dim 0)  moe_intermediate_size
``L.mlp.experts.{j}.down_proj``              row (dim 1)     moe_intermediate_size
``L.mlp.shared_experts.{gate,up}_proj``      column (dim 0)  moe_intermediate_size
``L.mlp.shared_experts.down_proj``           row (dim 1)     moe_intermediate_size
===========================================  ==============  =====================

Dims are those of an ``nn.Linear`` weight ``[out, in]``. Attention's split dims are
head-major (``[H * D]``), so tp equal contiguous parts are tp groups of whole heads.

Column-parallel: this rank's output features, no communication. Row-parallel: this rank's
input features, so the output is a PARTIAL sum; each decoder layer all-reduces twice (after
``o_proj`` and after the MLP/MoE, routed + shared summed first).

How the next layouts plug in here (and only here, plus the forward's collectives):

- Vocab-parallel embedding / lm_head: their rules become a ``VOCAB`` split of dim 0 with
  ``vocab_size`` as the unit; :class:`TPLayout` gains the local vocab size the two modules
  are built with; the embedding masks ids outside its range and all-reduces, lm_head
  all-gathers logits.
- Expert parallelism (EP over all dp x tp ranks of a role, DESIGN.md "Words"): the two
  ``mlp.experts.{j}`` rules become an ``EXPERT`` split with unit ``n_routed_experts`` over
  the EP group instead of the TP group: expert ``j`` is stored whole on EP rank
  ``j // (n_routed_experts / ep)`` and nowhere else (``local_slices`` answers "not here",
  so the loader never reads it), :class:`TPLayout` gains the rank's expert range (the MoE
  module builds only those experts), and the divisibility check covers ``ep`` the same way.
  The shared experts keep their TP rules; the MoE forward gains the all-to-all dispatch and
  combine.
- Layer sharding (prefill context parallel, DESIGN.md "Words"): a rule gains an owner
  policy "layer ``i`` on rank ``i % n`` of the CP group" for the chosen weights
  (``q_b_proj``, ``o_proj``, ...); the loader reads such a tensor only on its owner, and the
  model broadcasts it from the owner into a reused buffer one layer ahead of use. The split
  itself (replicated under CP) is unchanged, so the two compose in one rule.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum

from engine.model_config import ModelConfig
from engine.parallel import TPGroup


class Split(Enum):
    """How a weight ``[out, in]`` is split over the TP group; the value is the split dim."""

    REPLICATED = None  # whole tensor on every rank
    COLUMN = 0  # output features (dim 0) in tp contiguous parts
    ROW = 1  # input features (dim 1) in tp contiguous parts


@dataclass(frozen=True)
class ShardRule:
    """The layout of every parameter whose name fully matches ``pattern``.

    Attributes:
        pattern: regular expression, full match on the parameter (= checkpoint) name.
        split: how the tensor is split over the TP group.
        unit: for split tensors, the :class:`ModelConfig` field the TP size must divide
            (so the split keeps heads / intermediate channels whole); None when replicated.
    """

    pattern: str
    split: Split
    unit: str | None = None

    @property
    def dim(self) -> int | None:
        """The dim split over the TP group, or None (replicated)."""
        return self.split.value

    def local_slices(self, full_shape: tuple[int, ...], tp: TPGroup) -> tuple[slice, ...]:
        """Index of rank ``tp.rank``'s shard in the full tensor (contiguous part ``rank`` of
        ``tp.size`` along :attr:`dim`; everything when replicated)."""
        index = [slice(None)] * len(full_shape)
        if self.dim is not None and tp.size > 1:
            n = full_shape[self.dim] // tp.size
            index[self.dim] = slice(tp.rank * n, (tp.rank + 1) * n)
        return tuple(index)

    def full_shape(self, local_shape: tuple[int, ...], tp_size: int) -> tuple[int, ...]:
        """The checkpoint (unsplit) shape of a parameter whose local shape is ``local_shape``."""
        shape = list(local_shape)
        if self.dim is not None:
            shape[self.dim] *= tp_size
        return tuple(shape)


_L = r"model\.layers\.\d+\."
REPLICATED, COLUMN, ROW = Split.REPLICATED, Split.COLUMN, Split.ROW
_HEADS, _INTER, _MOE_INTER = "num_attention_heads", "intermediate_size", "moe_intermediate_size"

RULES: tuple[ShardRule, ...] = (
    ShardRule(r"model\.embed_tokens\.weight", REPLICATED),
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
    ShardRule(_L + r"mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight", COLUMN, _MOE_INTER),
    ShardRule(_L + r"mlp\.experts\.\d+\.down_proj\.weight", ROW, _MOE_INTER),
    ShardRule(_L + r"mlp\.shared_experts\.(gate_proj|up_proj)\.weight", COLUMN, _MOE_INTER),
    ShardRule(_L + r"mlp\.shared_experts\.down_proj\.weight", ROW, _MOE_INTER),
    ShardRule(r"model\.norm\.weight", REPLICATED),
    ShardRule(r"lm_head\.weight", REPLICATED),
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
"""The config sizes :data:`RULES` splits, each named once (the fields of :class:`TPLayout`)."""


@dataclass(frozen=True)
class TPLayout:
    """One TP rank's share of every config size the layout splits (:data:`SPLIT_UNITS`).

    Attributes:
        num_attention_heads: attention heads of this rank.
        intermediate_size: dense MLP intermediate channels of this rank.
        moe_intermediate_size: per-expert intermediate channels of this rank (shared experts:
            ``n_shared_experts`` times this).
    """

    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int


def tp_layout(config: ModelConfig, tp_size: int) -> TPLayout:
    """Local sizes of ``config`` under TP ``tp_size``; the one divisibility check.

    Raises:
        ValueError: ``tp_size`` is not positive, or does not divide a split size; the
            message names the field and the TP sizes that would work.
    """
    if tp_size < 1:
        raise ValueError(f"tp={tp_size}: the TP size must be at least 1")
    for unit in SPLIT_UNITS:
        full = getattr(config, unit)
        if full % tp_size:
            raise ValueError(f"tp={tp_size} does not divide {unit}={full} of the checkpoint's "
                             "config.json: use a tp that divides it (tp sizes that divide "
                             f"every split size: {_valid_tp_sizes(config)})")
    return TPLayout(**{unit: getattr(config, unit) // tp_size for unit in SPLIT_UNITS})


def _valid_tp_sizes(config: ModelConfig) -> list[int]:
    """TP sizes that divide every (nonzero) split size of ``config``."""
    common = math.gcd(*(getattr(config, unit) for unit in SPLIT_UNITS))
    return [n for n in range(1, common + 1) if common % n == 0]

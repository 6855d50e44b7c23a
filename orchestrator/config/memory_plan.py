"""Per-rank memory plan: what one rank of a role holds, by kind, from config.json and the layout.

The plan is a table: one :class:`Kind` per row (:data:`KINDS`) giving the ELEMENTS one rank
holds (a pure function of the :class:`engine.model_config.ModelConfig` and the
:class:`.role_layout.RoleLayout`) and its storage class; :class:`Precision` gives bytes per
element (quantized ``linear`` weights: :func:`engine.quant.memory.bytes_per_param`;
``kv_b_proj``, dequantized at load, stays ``weight``). Nothing is instantiated, no weights
read. The rows by group:

- weights (:mod:`.weight_rows`): each weight kind by the engine's split rules, the
  layer-sharding prefetch pool;
- KV (:mod:`.kv_rows`): the model's per-layer cache specs over the rank's pool;
- workspace and communicators (:mod:`.workspace_rows`): activations, logits, the buffers of
  the rank's NCCL/HCCL groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from engine.model_config import ModelConfig
from orchestrator.config import kv_rows, weight_rows, workspace_rows
from orchestrator.config.role_layout import RoleLayout

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


KINDS: tuple[Kind, ...] = (
    Kind("attention", "weights", "linear", weight_rows.attention),
    Kind("attention: kv_b_proj", "weights", "weight", weight_rows.attention_kv_b),
    Kind("dense MLP", "weights", "linear", weight_rows.dense_mlp),
    Kind("shared experts", "weights", "linear", weight_rows.shared_experts),
    Kind("routed experts", "weights", "linear", weight_rows.routed_experts),
    Kind("embedding", "weights", "weight", weight_rows.embedding),
    Kind("lm_head", "weights", "weight", weight_rows.lm_head),
    Kind("indexer (V3.2)", "weights", "linear", weight_rows.indexer, sparse_only=True),
    Kind("norms + router gate", "weights", "weight", weight_rows.norms_and_gate),
    Kind("layer-sharding prefetch", "workspace", "weight", weight_rows.prefetch_pool,
         layer_sharded_only=True),
    Kind("KV cache: c_kv latent", "kv", "kv", kv_rows.kv_latent),
    Kind("KV cache: k_pe", "kv", "kv", kv_rows.kv_rope),
    Kind("KV cache: index_k", "kv", "kv", kv_rows.kv_index, sparse_only=True),
    Kind("MTP module (speculative)", "weights", "linear", weight_rows.mtp_module,
         comm_only=True),
    Kind("KV cache: MTP layer", "kv", "kv", kv_rows.kv_mtp, comm_only=True),
    Kind("workspace: activations", "workspace", "activation", workspace_rows.activations),
    Kind("workspace: logits", "workspace", "fp32", workspace_rows.logits),
    Kind("comm: KV pair groups", "communicators", "byte", workspace_rows.pair_buffers,
         comm_only=True),
    Kind("comm: TP/EP/CP groups", "communicators", "byte", workspace_rows.collective_buffers,
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

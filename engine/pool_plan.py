"""How many blocks each KV group's pool gets, for every model family (the groups of
:func:`engine.kv_groups.kv_groups` of the layers' specs): the rank's KV budget split over the
groups in proportion to what its requests hold in each, so that no group runs out before the
others.

MLA (DeepSeek-V2/V3, V3.2, GLM-5) has one group, ``kv``, and is planned without a request
shape: its pool gets ``num_kv_blocks`` blocks of ``block_size`` token slots (the whole budget:
the prefix cache keeps what the running requests do not hold). DeepSeek-V4's groups (window,
entries and state per compressed kind) are planned for the role's request shape, as below.

Rule. Budget: ``num_kv_blocks`` blocks of ``block_size`` rows in every stored group (window,
entries; what ``num_kv_blocks`` allocated for V4 when every group had that many blocks, so no
config needs more KV memory than it did). One request of ``max_model_len`` tokens, written
``step_tokens`` at a time, holds at most ``r_g`` blocks of group g
(:func:`engine.kv_groups.reservation`: the window's span, its compressed entries, one
state block) and ``R`` elements in all stored groups. The pools hold ``n = min(max_num_seqs,
budget / R)`` such requests at once: stored group g gets ``floor(n x r_g)`` blocks, a state
group ``ceil(n)`` (one per request; held in the request's objects). With ``n = max_num_seqs``
the rest of the budget is not allocated (the workload cannot use it); below, every group
fills at the same number of max-length requests. Shorter requests hold fewer entries but the
same window span once past the window, so the window and state pools still bound them at
about ``n``.

Sources: vLLM's hybrid KV cache manager (docs.vllm.ai "Hybrid KV Cache Manager") keeps one
block pool that every group draws from, with one page size for all groups; V4's groups have
different row widths, so like TensorRT-LLM's per-window pools ("KV Cache System": memory
divided among the pools by a fraction fixed at initialisation) and SGLang's SWA pool (the
sliding-window layers' pool sized apart from the full layers', ``--swa-full-tokens-ratio``)
each group has a pool of its own, the fraction here set by the request shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_groups import KVGroup, kv_groups, reservation
from engine.kv_layer_spec import PER_REQUEST, LayerKVSpec


@dataclass(frozen=True)
class RequestShape:
    """The requests a rank's pools are sized for.

    Attributes:
        max_num_seqs: requests held at once (the pools hold at most this many
            ``max_model_len`` requests). max_model_len: tokens of the longest request
            (prompt + output). step_tokens: tokens a request writes per step (the scheduler's
            ``chunk_size``: prefill chunk, 1 on decode), which widens the window's span.

    Raises:
        ValueError: a size < 1.
    """

    max_num_seqs: int
    max_model_len: int
    step_tokens: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "step_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RequestShape.{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class PoolPlan:
    """Blocks per group of one rank's V4 pools, and what they hold.

    Attributes:
        blocks: group name -> blocks of its pool. block_sizes: group name -> rows per block
            (state groups 1). row_elements: group name -> elements of one row (all its
            layers). per_request: group name -> blocks one ``max_model_len`` request holds
            (None: no shape, every group ``num_kv_blocks``). budget_requests: ``max_model_len``
            requests the budget would hold (0.0 without a shape). requests: those every group
            holds at once, ``min(max_num_seqs, budget_requests)`` (fractional: the budget's
            share). capped: sized by ``max_num_seqs``, below the budget.
    """

    blocks: dict[str, int]
    block_sizes: dict[str, int]
    row_elements: dict[str, int]
    per_request: dict[str, int] | None
    budget_requests: float
    requests: float
    capped: bool

    def elements(self, group: str) -> int:
        """Elements of ``group``'s pool: blocks x rows per block x row elements (a state
        group: one request's largest open-group state per block, held in its objects)."""
        return self.blocks[group] * self.block_sizes[group] * self.row_elements[group]

    def stored_elements(self) -> int:
        """Elements of the tensors :class:`engine.v4.paged_cache.PagedKV` allocates (window and
        entries groups)."""
        return sum(self.elements(g) for g in self.blocks if not g.startswith("state/"))


def _stored(group: KVGroup) -> bool:
    return group.per != PER_REQUEST


def plan_pools(specs: Sequence[LayerKVSpec], num_kv_blocks: int, block_size: int,
               shape: RequestShape | None) -> PoolPlan:
    """The pools of a rank whose layers cache ``specs`` (one per layer:
    :func:`engine.kv_layer_spec.mla_layer_specs`, :func:`engine.v4.kv_spec.layer_specs`;
    module docstring); ``shape`` None: every group ``num_kv_blocks`` blocks (MLA; V4 without a
    request shape to size by: unit use of the runner).

    Raises:
        ValueError: ``num_kv_blocks`` or ``block_size`` < 1 (or :func:`kv_groups`' error).
    """
    if num_kv_blocks < 1 or block_size < 1:
        raise ValueError(f"num_kv_blocks ({num_kv_blocks}) and block_size ({block_size}) must "
                         "be >= 1")
    groups = kv_groups(specs)
    sizes = {g.name: block_size if _stored(g) else 1 for g in groups}
    widths = {g.name: g.row_elements for g in groups}
    if shape is None:
        return PoolPlan({g.name: num_kv_blocks for g in groups}, sizes, widths, None,
                        0.0, 0.0, False)
    held = reservation(groups, sizes, shape.max_model_len, shape.step_tokens)
    budget = num_kv_blocks * block_size * sum(g.row_elements for g in groups if _stored(g))
    per_request = sum(held[g.name] * block_size * g.row_elements for g in groups if _stored(g))
    capped = budget >= shape.max_num_seqs * per_request
    if capped:  # NOTE: integer maths: floor(n x r_g) exactly
        blocks = {g.name: shape.max_num_seqs * (held[g.name] if _stored(g) else 1)
                  for g in groups}
    else:
        blocks = {g.name: max(1, budget * held[g.name] // per_request if _stored(g)
                              else -(-budget // per_request)) for g in groups}
    fits = budget / per_request
    return PoolPlan(blocks, sizes, widths, held, fits, min(float(shape.max_num_seqs), fits),
                    capped)


__all__ = ["PoolPlan", "RequestShape", "plan_pools"]

"""KV groups: the layers' cached rows that share block ids, read off the per-layer specs
(:mod:`engine.kv_layer_spec`) for every family (vLLM's KV cache groups; its hybrid KV cache
manager gives each group its own block table).

- the ``token`` group: every layer's per-token tensors, one row per token, all layers under
  one block id. MLA (DeepSeek-V2/V3, V3.2, GLM-5) keeps every token's row: group ``kv`` (k, v
  and index_k of every layer: the one paged cache :class:`engine.kv_cache.KVCache` holds).
  DeepSeek-V4 keeps only the last ``sliding_window - 1`` tokens: group ``window``, whose blocks
  wholly before them go back to the pool as a request advances.
- per compressed kind (V4's CSA, HCA), ``entries/<kind>``: one row per compressed entry of
  every layer of that kind (compressed kv + indexer keys; they only grow), and
  ``state/<kind>``: the compressors' open-group state, a fixed size per request (one block of
  one row).

Each group's pool is sized by :func:`engine.pool_plan.plan_pools`; :func:`reservation` is the
most blocks per group one request holds. A family whose specs have no entry tensors (MLA) has
the ``kv`` group only, and its reservation is ``ceil(tokens / block_size)``: what the
scheduler's pool (:meth:`engine.block_pool.BlockPool.blocks_needed`) reserves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.kv_layer_spec import PER_ENTRY, PER_REQUEST, PER_TOKEN, LayerKVSpec

KV, WINDOW = "kv", "window"


@dataclass(frozen=True)
class KVGroup:
    """Rows that share block ids across the layers of a group.

    Attributes:
        name: ``kv`` / ``window`` (the token group), ``entries/<kind>`` or ``state/<kind>``.
        per: ``token``, ``entry`` or ``request`` (one row per request). layers: the layers
            in the group.
        row_elements: elements of one row summed over its tensors and layers (x dtype size
            = bytes). keep_tokens: tokens kept by a ``token`` group (0: all).
        compress_ratio: tokens per row of an ``entry`` group (1 otherwise).
    """

    name: str
    per: str
    layers: tuple[int, ...]
    row_elements: int
    keep_tokens: int = 0
    compress_ratio: int = 1

    def rows(self, num_tokens: int) -> int:
        """Rows a request of ``num_tokens`` tokens needs (``token`` groups: from its first
        kept token on; see :meth:`engine.v4.block_table.RequestBlocks.first_kept`)."""
        if self.per == PER_REQUEST:
            return 1
        return num_tokens // self.compress_ratio if self.per == PER_ENTRY else num_tokens


def kv_groups(specs: Sequence[LayerKVSpec]) -> tuple[KVGroup, ...]:
    """The groups of the layers ``specs`` (one per layer, e.g.
    :func:`engine.kv_layer_spec.mla_layer_specs`, :func:`engine.v4.kv_spec.layer_specs`):
    the token group first, then per compressed kind its entries and state.

    Raises:
        ValueError: no layers, or layers that keep different token windows (one token group
            keeps one).
    """
    keep = {s.kept_tokens for s in specs}
    if len(keep) != 1:
        raise ValueError(f"KV groups need layers that keep one token window; got {sorted(keep)}"
                         " (0: every token)")
    keep_tokens = keep.pop()
    token = [i for i, s in enumerate(specs) if any(t.per == PER_TOKEN for t in s.tensors())]
    width = sum(t.width for i in token for t in specs[i].tensors() if t.per == PER_TOKEN)
    groups = [KVGroup(WINDOW if keep_tokens else KV, PER_TOKEN, tuple(token), width,
                      keep_tokens=keep_tokens)]
    for kind in dict.fromkeys(s.kind for s in specs if s.entry_tokens):
        layers = tuple(i for i, s in enumerate(specs) if s.kind == kind)
        spec = specs[layers[0]]
        entry = sum(t.width for t in spec.tensors() if t.per == PER_ENTRY)
        state = sum(t.rows * t.width for t in spec.tensors() if t.per == PER_REQUEST)
        groups += [KVGroup(f"entries/{kind}", PER_ENTRY, layers, entry * len(layers),
                           compress_ratio=spec.entry_tokens),
                   KVGroup(f"state/{kind}", PER_REQUEST, layers, state * len(layers))]
    return tuple(groups)


def reservation(groups: tuple[KVGroup, ...], block_sizes: dict[str, int], num_tokens: int,
                step_tokens: int) -> dict[str, int]:
    """Most blocks per group one request holds on its way to ``num_tokens`` tokens written
    ``step_tokens`` at a time (1 for decode): a window spans at most ``keep_tokens +
    step_tokens`` tokens (+1 block: the span need not start on a block edge), not the whole
    context; a token group that keeps every token (MLA) and entries grow with the context;
    state is one block."""
    out = {}
    for g in groups:
        size = block_sizes[g.name]
        if g.per == PER_TOKEN and g.keep_tokens:
            span = -(-(g.keep_tokens + step_tokens) // size) + 1
            out[g.name] = min(span, -(-num_tokens // size))
        else:
            out[g.name] = -(-g.rows(num_tokens) // size)
    return out


__all__ = ["KV", "KVGroup", "WINDOW", "kv_groups", "reservation"]

"""Paged blocks of one DeepSeek-V4 request, per KV group (vLLM's hybrid KV cache groups):
what the block pools hold for it and when they get blocks back.

Groups (:func:`engine.kv_groups.kv_groups` of :func:`engine.v4.kv_spec.layer_specs`, the
function MLA's one ``kv`` group comes from too): ``window`` (every layer's raw
K=V, one row per token; only the last ``sliding_window - 1`` tokens are kept, so blocks wholly
before them go back to the pool as the request advances), ``entries/<kind>`` (one row per
compressed entry of every layer of that kind: ``compressed_kv`` + ``index_keys``; they only
grow) and ``state/<kind>`` (the compressors' open-group state, a fixed size per request: one
block of one row). Each group has its own :class:`engine.block_pool.BlockPool` (block sizes in
rows), so a block id means the same rows in every layer of its group.

NOTE: this is the accounting the scheduler, reservation and transfer plan need;
:mod:`engine.v4.paged_cache` stores the rows at these blocks.
"""

from __future__ import annotations

from collections import deque

from engine.block_pool import BlockPool, BlockSet, NoFreeBlocksError
from engine.kv_groups import KVGroup, kv_groups
from engine.v4.config import V4Config
from engine.v4.kv_spec import PER_REQUEST, PER_TOKEN, layer_specs


def group_bytes(config: V4Config, num_blocks: int, block_size: int, dtype_bytes: int
                ) -> dict[str, int]:
    """Bytes per group of pools of ``num_blocks`` blocks each (the uniform layout; a rank's
    pools are sized per group, :func:`engine.pool_plan.plan_pools`): ``window`` and
    ``entries/<kind>`` rows are the tensors :class:`engine.v4.paged_cache.PagedKV` allocates
    (``num_blocks x block_size x row_elements x dtype_bytes``); a ``state/<kind>`` block is one
    request's compressor / indexer open-group state at its largest (held in the request's
    objects, allocated as it runs: ``num_blocks x row_elements x dtype_bytes`` at most)."""
    return {g.name: num_blocks * (1 if g.per == PER_REQUEST else block_size) * g.row_elements
            * dtype_bytes for g in kv_groups(layer_specs(config))}


class RequestBlocks:
    """One request's block sets in every group's pool (``pools[group.name]``; state pools
    have block size 1). Window blocks are held one per set, so each can go back alone.

    Use: ``can_grow(n)`` then ``grow(n)`` before a step that brings the request to n tokens,
    ``advance(n)`` after it (frees window blocks no query will read again), ``free()`` once.
    """

    def __init__(self, groups: tuple[KVGroup, ...], pools: dict[str, BlockPool]) -> None:
        self.groups, self.pools = groups, pools
        self.window: deque[tuple[int, BlockSet]] = deque()  # (logical block index, set)
        self.sets: dict[str, list[BlockSet]] = {g.name: [] for g in groups}
        self.num_tokens = 0  # tokens whose rows are written

    def first_kept(self, num_tokens: int, group: KVGroup) -> int:
        """First token a ``token`` group still needs once ``num_tokens`` are written."""
        return max(0, num_tokens - group.keep_tokens) if group.keep_tokens else 0

    def needed(self, num_tokens: int) -> dict[str, int]:
        """Blocks each group must add to hold ``num_tokens`` tokens. No side effect."""
        out = {}
        for g in self.groups:
            size = self.pools[g.name].block_size
            if g.per == PER_TOKEN:
                first = self.first_kept(self.num_tokens, g) // size
                last = -(-num_tokens // size)  # exclusive
                held = self.window[-1][0] + 1 if self.window else first
                out[g.name] = max(0, last - max(held, first))
            else:
                held = sum(len(s) for s in self.sets[g.name])
                out[g.name] = max(0, -(-g.rows(num_tokens) // size) - held)
        return out

    def can_grow(self, num_tokens: int) -> bool:
        """True when :meth:`grow` to ``num_tokens`` would succeed now."""
        return all(self.pools[name].can_allocate(n) for name, n in self.needed(num_tokens).items())

    def grow(self, num_tokens: int) -> None:
        """Allocate the blocks to write tokens up to ``num_tokens``.

        Raises:
            NoFreeBlocksError: some group's pool is short; nothing is taken.
        """
        need = self.needed(num_tokens)
        if not self.can_grow(num_tokens):
            raise NoFreeBlocksError(f"V4 request needs blocks {need}; free: "
                                    f"{ {n: p.num_free_blocks for n, p in self.pools.items()} }")
        for g in self.groups:
            pool = self.pools[g.name]
            if g.per != PER_TOKEN:
                if need[g.name]:
                    self.sets[g.name].append(pool.allocate(need[g.name]))
                continue
            start = (self.window[-1][0] + 1 if self.window
                     else self.first_kept(self.num_tokens, g) // pool.block_size)
            for index in range(start, start + need[g.name]):
                self.window.append((index, pool.allocate(1)))

    def advance(self, num_tokens: int) -> int:
        """``num_tokens`` are written: free the window blocks wholly before the kept tokens.
        Returns how many blocks went back."""
        self.num_tokens = num_tokens
        group = self.groups[0]
        size = self.pools[group.name].block_size
        first = self.first_kept(num_tokens, group)
        freed = 0
        while self.window and (self.window[0][0] + 1) * size <= first:
            self.pools[group.name].free(self.window.popleft()[1])
            freed += 1
        return freed

    def held(self) -> dict[str, int]:
        """Blocks held now, per group."""
        out = {name: sum(len(s) for s in sets) for name, sets in self.sets.items()}
        out[self.groups[0].name] = len(self.window)
        return out

    def free(self) -> None:
        """Return every block (exactly once: a second call raises DoubleFreeError from the
        pool)."""
        for _, block_set in self.window:
            self.pools[self.groups[0].name].free(block_set)
        for name, sets in self.sets.items():
            for block_set in sets:
                self.pools[name].free(block_set)
        self.window.clear()
        self.sets = {name: [] for name in self.sets}

"""Paged KV block allocator: check-then-commit, opaque block sets, exactly-once free.

The pool is the only owner of the free list: ``can_allocate(n)`` (no side effect), then
``allocate(n)`` -> :class:`BlockSet`, returned with ``free(block_set)`` exactly once (a second
free, or a set from another pool, raises). Slots follow vLLM's paged attention:
``slot = block_id * block_size + offset``.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass

import torch


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class DoubleFreeError(RuntimeError):
    """Raised by :meth:`BlockPool.free` when a block set was already returned."""


@dataclass(frozen=True)
class BlockSet:
    """An opaque handle to blocks owned by one request.

    Attributes:
        set_id: unique per pool; used to detect double frees.
        block_ids: the physical block ids, in logical order (block table of the request).
        pool_id: id of the pool that issued it.
    """

    set_id: int
    block_ids: tuple[int, ...]
    pool_id: int

    def __len__(self) -> int:
        return len(self.block_ids)


_POOL_IDS = itertools.count()


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each.

    NOTE: thread-safe: the step loop and the actor's concurrent RPC threads (reserve, abort,
    status) allocate and free, some outside the rank's lock; KV transfer threads never
    touch it (they write into slots a reservation holds).

    Raises:
        ValueError: if either argument is not positive.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._pool_id = next(_POOL_IDS)
        self._free: deque[int] = deque(range(num_blocks))
        self._live: dict[int, BlockSet] = {}
        self._next_set = itertools.count()
        self._lock = threading.Lock()

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    @property
    def num_live_sets(self) -> int:
        """Block sets handed out and not yet freed (0 when nothing leaks)."""
        with self._lock:
            return len(self._live)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """True when ``allocate(num_blocks)`` would succeed now. No side effect."""
        with self._lock:
            return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> BlockSet:
        """Take ``num_blocks`` blocks off the free list.

        Raises:
            NoFreeBlocksError: fewer than ``num_blocks`` blocks are free; nothing is taken.
            ValueError: ``num_blocks`` is negative or larger than the whole pool.
        """
        if num_blocks < 0 or num_blocks > self.num_blocks:
            raise ValueError(
                f"asked for {num_blocks} blocks; the pool has {self.num_blocks} in all"
            )
        with self._lock:
            if num_blocks > len(self._free):
                raise NoFreeBlocksError(
                    f"asked for {num_blocks} KV blocks, {len(self._free)} free of "
                    f"{self.num_blocks}"
                )
            ids = tuple(self._free.popleft() for _ in range(num_blocks))
            block_set = BlockSet(next(self._next_set), ids, self._pool_id)
            self._live[block_set.set_id] = block_set
            return block_set

    def free(self, block_set: BlockSet) -> None:
        """Return a block set to the pool.

        Raises:
            DoubleFreeError: the set was already freed (or never came from this pool).
        """
        with self._lock:
            if block_set.pool_id != self._pool_id or block_set.set_id not in self._live:
                raise DoubleFreeError(
                    f"block set {block_set.set_id} ({len(block_set)} blocks) was already "
                    "freed or belongs to another pool"
                )
            del self._live[block_set.set_id]
            self._free.extend(block_set.block_ids)


def slot_mapping(block_ids: tuple[int, ...] | list[int], start: int, end: int,
                 block_size: int) -> torch.Tensor:
    """Slots of logical token positions ``[start, end)`` of one request.

    Returns ``[end - start]`` int64, ``slot = block_ids[p // bs] * bs + p % bs``.

    Raises:
        ValueError: the range does not fit in the block table.
    """
    if not 0 <= start <= end <= len(block_ids) * block_size:
        raise ValueError(
            f"token range [{start}, {end}) does not fit {len(block_ids)} blocks of {block_size}"
        )
    pos = torch.arange(start, end, dtype=torch.int64)
    table = torch.as_tensor(block_ids, dtype=torch.int64)
    return table[pos // block_size] * block_size + pos % block_size

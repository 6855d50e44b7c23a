"""Paged KV block allocator with a prefix cache: check-then-commit, opaque block sets,
reference counts, exactly-once free.

The pool is the only owner of the free list: ``can_allocate(n, hashes)`` (no side effect), then
``allocate(n, hashes)`` -> :class:`BlockSet`, returned with ``free(block_set)`` exactly once (a
second free, or a set from another pool, raises). Slots follow vLLM's paged attention:
``slot = block_id * block_size + offset``.

Prefix cache (on when the pool has a ``salt``; vLLM's automatic prefix caching): a full block
whose KV is complete is registered under its chained hash (engine/prefix_hash.py,
:meth:`BlockPool.cache_blocks`). ``allocate(n, hashes)`` hands the longest cached prefix of
``hashes`` out again (its blocks' reference counts go up) and takes only the rest off the free
list. A block nobody references goes back to the free list; a cached one stays findable there
until an allocation needs a block and none uncached is free: then the least recently freed
cached block is evicted (its hash forgotten). A referenced block is never handed out for other
tokens, so nothing written or read by a request or a KV transfer is overwritten.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.kv_events import KVCacheEvents, KVEventLog


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
        num_cached: leading blocks found in the prefix cache (their KV is already there).
    """

    set_id: int
    block_ids: tuple[int, ...]
    pool_id: int
    num_cached: int = 0

    def __len__(self) -> int:
        return len(self.block_ids)


_POOL_IDS = itertools.count()


class BlockPool:
    """Fixed pool of ``num_blocks`` KV blocks of ``block_size`` tokens each.

    ``salt``: the prefix cache's hash root (engine/prefix_hash.py ``cache_salt``); None turns
    the prefix cache off (``hashes`` are then ignored and nothing is cached).

    NOTE: thread-safe: the step loop and the actor's concurrent RPC threads (reserve, abort,
    status) allocate and free, some outside the rank's lock; KV transfer threads never
    touch it (they write into slots a reservation holds).

    Raises:
        ValueError: if either size is not positive.
    """

    def __init__(self, num_blocks: int, block_size: int, salt: int | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.salt = salt
        self._pool_id = next(_POOL_IDS)
        self._free: deque[int] = deque(range(num_blocks))  # free, not cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; LRU first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}   # block id -> hash of its cached KV
        self._block_of: dict[int, int] = {}  # hash -> block id
        self._live: dict[int, BlockSet] = {}
        self._next_set = itertools.count()
        self._lock = threading.Lock()
        self._events = KVEventLog(4 * num_blocks)
        self._queried = self._hit = 0
        # NOTE: called with each freed set (after the free, outside the lock); DeepSeek-V4's
        # runner frees its per-group blocks with it (engine/v4/runner.py)
        self.on_free: Callable[[BlockSet], None] | None = None

    @property
    def caching(self) -> bool:
        """The prefix cache is on."""
        return self.salt is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are reusable)."""
        with self._lock:
            return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose KV is findable by hash (held or free)."""
        with self._lock:
            return len(self._hash_of)

    @property
    def num_live_sets(self) -> int:
        """Block sets handed out and not yet freed (0 when nothing leaks)."""
        with self._lock:
            return len(self._live)

    @property
    def num_referenced_blocks(self) -> int:
        """Blocks with a reference count above zero (0 when nothing leaks)."""
        with self._lock:
            return sum(1 for r in self._refs if r)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` are cached now (0 with the cache off). No side effect."""
        with self._lock:
            return len(self._hits(hashes))

    def can_allocate(self, num_blocks: int, hashes: Sequence[int] = ()) -> bool:
        """True when ``allocate(num_blocks, hashes)`` would succeed now. No side effect."""
        with self._lock:
            return self._fresh_needed(num_blocks, self._hits(hashes)) <= \
                len(self._free) + len(self._evictable)

    def allocate(self, num_blocks: int, hashes: Sequence[int] = ()) -> BlockSet:
        """Take ``num_blocks`` blocks: the cached prefix of ``hashes`` (at most
        ``num_blocks``) first, then blocks off the free list (evicting the least recently
        freed cached ones when no uncached block is free).

        Raises:
            NoFreeBlocksError: not enough blocks are free; nothing is taken.
            ValueError: ``num_blocks`` is negative or larger than the whole pool.
        """
        if num_blocks < 0 or num_blocks > self.num_blocks:
            raise ValueError(
                f"asked for {num_blocks} blocks; the pool has {self.num_blocks} in all"
            )
        with self._lock:
            hits = self._hits(hashes)[:num_blocks]
            free = len(self._free) + len(self._evictable)
            if self._fresh_needed(num_blocks, hits) > free:
                cached = f" ({len(hits)} of them cached)" if hits else ""
                raise NoFreeBlocksError(
                    f"asked for {num_blocks} KV blocks{cached}, {free} free of "
                    f"{self.num_blocks}"
                )
            for b in hits:
                self._evictable.pop(b, None)
                self._refs[b] += 1
            fresh = [self._take_free() for _ in range(num_blocks - len(hits))]
            block_set = BlockSet(next(self._next_set), tuple(hits) + tuple(fresh),
                                 self._pool_id, num_cached=len(hits))
            self._live[block_set.set_id] = block_set
            return block_set

    def cache_blocks(self, block_set: BlockSet, first: int, hashes: Sequence[int]) -> None:
        """Register blocks ``first .. first + len(hashes) - 1`` of a live ``block_set`` under
        ``hashes``: their KV is complete on every rank. A block already cached, or a hash
        another block holds, is left as it is. No-op with the cache off.

        Raises:
            DoubleFreeError: the set is not live.
        """
        if not self.caching:
            return
        with self._lock:
            self._check_live(block_set)
            for b, h in zip(block_set.block_ids[first:], hashes):
                if b in self._hash_of or h in self._block_of:
                    continue
                self._hash_of[b], self._block_of[h] = h, b
                self._events.store(h)

    def free(self, block_set: BlockSet) -> None:
        """Return a block set to the pool (its blocks' reference counts go down; a cached block
        nobody holds stays findable until evicted).

        Raises:
            DoubleFreeError: the set was already freed (or never came from this pool).
        """
        with self._lock:
            self._check_live(block_set)
            del self._live[block_set.set_id]
            self._unref(block_set.block_ids)
        if self.on_free is not None:
            self.on_free(block_set)

    def truncate(self, block_set: BlockSet, keep: int) -> BlockSet:
        """Give back all but the first ``keep`` blocks of a live set (as :meth:`free` does
        them; ``on_free`` is not called: the set lives on). Returns the set's new handle
        (same ``set_id``); the old handle is stale (freeing it raises).

        Raises:
            DoubleFreeError: the set is not live. ValueError: ``keep`` not in 1 .. its size.
        """
        if not 1 <= keep <= len(block_set):
            raise ValueError(f"keep {keep} of a set of {len(block_set)} blocks")
        with self._lock:
            self._check_live(block_set)
            self._unref(block_set.block_ids[keep:])
            kept = BlockSet(block_set.set_id, block_set.block_ids[:keep], self._pool_id,
                            num_cached=min(block_set.num_cached, keep))
            self._live[block_set.set_id] = kept
            return kept

    def note_lookup(self, queried_tokens: int, cached_tokens: int) -> None:
        """Count one admission's prompt tokens looked up / found cached (hit rate)."""
        with self._lock:
            self._events.lookup(queried_tokens, cached_tokens)
            self._queried += queried_tokens
            self._hit += cached_tokens

    def lookup_totals(self) -> tuple[int, int]:
        """(prompt tokens looked up, found cached) since the pool was made."""
        with self._lock:
            return self._queried, self._hit

    def take_events(self) -> KVCacheEvents | None:
        """The cache's changes since the previous call (None with the cache off)."""
        if not self.caching:
            return None
        with self._lock:
            return self._events.take(self.block_size, self.salt, self._block_of)

    def _hits(self, hashes: Sequence[int]) -> list[int]:
        """Caller holds the lock: block ids of the cached prefix of ``hashes``."""
        hits: list[int] = []
        if not self.caching:
            return hits
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def _fresh_needed(self, num_blocks: int, hits: list[int]) -> int:
        """Caller holds the lock: free-list blocks an allocation with ``hits`` takes (a hit
        nobody holds leaves the free list too)."""
        hits = hits[:num_blocks]
        return num_blocks - len(hits) + sum(1 for b in hits if not self._refs[b])

    def _take_free(self) -> int:
        """Caller holds the lock: one block off the free list, uncached ones first."""
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._block_of[h]
            self._events.remove(h)
        self._refs[b] = 1
        return b

    def _unref(self, block_ids: Sequence[int]) -> None:
        """Caller holds the lock: one reference less on each block; one nobody holds goes back
        to the free list (a cached one stays findable there until evicted)."""
        # NOTE: tail blocks first: they are evicted before the prefix they extend
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            if b in self._hash_of:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _check_live(self, block_set: BlockSet) -> None:
        if block_set.pool_id != self._pool_id or \
                self._live.get(block_set.set_id) != block_set:  # NOTE: a stale handle too
            raise DoubleFreeError(
                f"block set {block_set.set_id} ({len(block_set)} blocks) was already "
                "freed or belongs to another pool"
            )


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

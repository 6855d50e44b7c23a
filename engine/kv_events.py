"""KV cache events: which prefix-cache blocks an instance stored and evicted (Dynamo's KV events).

The block pool (engine/block_pool.py) records one stream per instance; the leader hands a batch
to the router with its token events (rank/messages.py ``TokenEvent.kv_events``) and the
router's index (orchestrator/router/kv_index.py) keeps, per instance, the block hashes it holds.
Imports neither torch nor Ray (the router and the client read it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheEvents:
    """One batch of an instance's prefix-cache changes, in order: apply ``reset`` first, then
    ``stored``, then ``removed``.

    Attributes:
        block_size: tokens per block of the hashes.
        salt: the hash chain's root (engine/prefix_hash.py ``cache_salt``): the router hashes a
            prompt with it to look the instance's blocks up.
        stored: block hashes that became cached (their KV complete).
        removed: block hashes evicted (their block reused for other tokens).
        reset: forget everything known about the instance first (its pool is new: the first
            batch after a start, or the pool dropped events it could not hold; ``stored``
            then lists every cached block).
        hits_tokens / queried_tokens: prompt tokens found cached / looked up since the
            previous batch (hit rate).
    """

    block_size: int
    salt: int
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    reset: bool = False
    hits_tokens: int = 0
    queried_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.reset or self.queried_tokens)


class KVEventLog:
    """A block pool's pending KV events, net of each other (a hash stored then evicted within
    one batch reads as evicted), at most ``limit`` hashes: past it, the next batch is a reset
    with every cached hash. Not thread-safe: the pool calls it under its lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stored: dict[int, None] = {}
        self.removed: dict[int, None] = {}
        self.reset = True  # NOTE: the first batch tells the router to forget older entries
        self.hits = self.queried = 0

    def store(self, h: int) -> None:
        if not self.reset:  # NOTE: a pending reset's batch is a snapshot: nothing to add
            self.removed.pop(h, None)
            self.stored[h] = None
            self._bound()

    def remove(self, h: int) -> None:
        if not self.reset:
            self.stored.pop(h, None)
            self.removed[h] = None
            self._bound()

    def lookup(self, queried: int, hits: int) -> None:
        self.queried += queried
        self.hits += hits

    def take(self, block_size: int, salt: int, cached: dict[int, int]) -> KVCacheEvents:
        stored = tuple(cached) if self.reset else tuple(self.stored)
        out = KVCacheEvents(block_size, salt, stored, tuple(self.removed), self.reset,
                            self.hits, self.queried)
        self.stored, self.removed, self.reset = {}, {}, False
        self.hits = self.queried = 0
        return out

    def _bound(self) -> None:
        if len(self.stored) + len(self.removed) > self.limit:
            self.stored, self.removed, self.reset = {}, {}, True

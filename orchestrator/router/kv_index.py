"""The router's view of which prefix-cache blocks each instance holds, built from the KV events
the instances report (engine/kv_events.py; Dynamo's KV router indexer, reduced to a hash set per
instance: one chained hash names a whole prefix, so a prompt's cached length on an instance is
its count of leading block hashes in that instance's set).

Bounded: at most ``max_blocks`` hashes per instance (oldest dropped first past it; an instance
never caches more than its pool). An instance's entries are dropped when its pool reports a
reset (a new pool: the instance restarted) or on :meth:`KVIndex.drop`. Read and written on the
router's event loop only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.kv_events import KVCacheEvents
from engine.prefix_hash import block_hashes, reusable_blocks


@dataclass
class InstanceCache:
    """What the router knows of one instance's prefix cache.

    Attributes:
        block_size, salt: how the instance names blocks (its last batch's).
        blocks: the hashes it holds, oldest stored first.
        hits_tokens, queried_tokens: prompt tokens found cached / looked up since it started.
    """

    block_size: int
    salt: int
    blocks: dict[int, None]
    hits_tokens: int = 0
    queried_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVIndex:
    """Per instance, the prefix-cache block hashes it reported (see module docstring).

    Args:
        max_blocks: most hashes kept per instance.
    """

    def __init__(self, max_blocks: int = 1 << 18) -> None:
        self.max_blocks = max_blocks
        self._caches: dict[str, InstanceCache] = {}

    def apply(self, instance: str, events: KVCacheEvents) -> None:
        """Apply one batch of ``instance``'s events (reset, then stored, then removed)."""
        cache = self._caches.get(instance)
        if cache is None or events.reset or (cache.block_size, cache.salt) != \
                (events.block_size, events.salt):
            cache = self._caches[instance] = InstanceCache(events.block_size, events.salt, {})
        for h in events.stored:
            cache.blocks[h] = None
        for h in events.removed:
            cache.blocks.pop(h, None)
        while len(cache.blocks) > self.max_blocks:
            del cache.blocks[next(iter(cache.blocks))]
        cache.hits_tokens += events.hits_tokens
        cache.queried_tokens += events.queried_tokens

    def drop(self, instance: str) -> None:
        """Forget ``instance`` (replaced or removed)."""
        self._caches.pop(instance, None)

    def get(self, instance: str) -> InstanceCache | None:
        return self._caches.get(instance)

    def cached_tokens(self, instances: Iterable[str],
                      prompt_token_ids: Sequence[int]) -> dict[str, int]:
        """instance -> leading prompt tokens it holds in full cached blocks that an admission
        may reuse (at most :func:`reusable_blocks`: the engine computes the last prompt token
        always; 0 for one that reported nothing). The prompt is hashed once per distinct
        (block size, salt)."""
        hashes: dict[tuple[int, int], list[int]] = {}
        out = {}
        for name in instances:
            cache = self._caches.get(name)
            if cache is None or not cache.blocks:
                out[name] = 0
                continue
            key = (cache.block_size, cache.salt)
            if key not in hashes:
                usable = reusable_blocks(len(prompt_token_ids), cache.block_size)
                hashes[key] = block_hashes(prompt_token_ids[:usable * cache.block_size],
                                           cache.block_size, cache.salt)
            n = 0
            for h in hashes[key]:
                if h not in cache.blocks:
                    break
                n += 1
            out[name] = n * cache.block_size
        return out

"""One rank's DeepSeek-V4 request caches (:class:`RequestCaches`): keyed by request id, each
named by its scheduler block set's first block, and freed when the scheduler pool frees that
set.

A free is recorded at once (:meth:`RequestCaches.release`, any thread: the pool's
``on_free``) and applied on the step's thread before the next step or rebuild takes blocks, or,
when the leader's loop has nothing to run, in its next idle iteration
(``rank.rank.Rank.free_idle_releases``). At tp 1 the runner applies its own releases there
(:meth:`RequestCaches.apply_releases`). Under TP only the leader's pool frees, but every rank
holds the request's (whole) cache: the leader takes the released request ids
(:meth:`RequestCaches.take_releases`) and every rank frees them
(:meth:`RequestCaches.free_requests`) right before the same step (``rank.spmd.StepSync``) or,
idle, at once (``rank.spmd.SPMDGroup.free_released``), so all ranks' V4 pools hold the same
blocks. NOTE: frees go by request id, never by block id: a
scheduler block may name a new request by the time a rank applies them.
"""

from __future__ import annotations

import threading

from engine.v4.paged_cache import PagedV4Cache


class RequestCaches:
    """The caches (``caches``: request id -> :class:`PagedV4Cache`) of one rank; ``tp_size``:
    its TP group's size (> 1: :meth:`apply_releases` leaves frees to the rank's step)."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.caches: dict[str, PagedV4Cache] = {}
        self._owner: dict[int, str] = {}  # first scheduler block id -> request id
        self._released: list[int] = []  # first block ids of freed scheduler block sets
        self._lock = threading.Lock()

    def add(self, request_id: str, first_block: int, cache: PagedV4Cache) -> PagedV4Cache:
        """Keep ``cache`` for ``request_id``, freed when the block set starting at
        ``first_block`` is released; returns it."""
        self.caches[request_id] = cache
        self._owner[first_block] = request_id
        return cache

    def release(self, first_block: int) -> None:
        """The scheduler pool freed the block set starting at ``first_block`` (any thread)."""
        with self._lock:
            self._released.append(first_block)

    def take_releases(self) -> tuple[str, ...]:
        """The request ids of the block sets released since the last call (their names
        dropped, their caches still held: :meth:`free_requests` frees them)."""
        with self._lock:
            released, self._released = self._released, []
        rids = (self._owner.pop(first, None) for first in released)
        return tuple(rid for rid in rids if rid is not None)

    def free_requests(self, request_ids: tuple[str, ...]) -> None:
        """Free the caches of ``request_ids``, each once (an id with no cache is skipped)."""
        for rid in request_ids:
            cache = self.caches.pop(rid, None)
            if cache is None:
                continue
            for first in [f for f, owner in self._owner.items() if owner == rid]:
                del self._owner[first]
            cache.free()

    def apply_releases(self) -> None:
        """Tp 1: free what was released. Under TP a no-op (the rank's step frees the
        leader's releases on every rank)."""
        if self.tp_size == 1:
            self.free_requests(self.take_releases())

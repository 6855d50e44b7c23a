"""Per-pair KV transfer records of one prefill rank, for the router's metrics.

A record (:class:`rank.messages.TransferRecord`, carried as is in ``status().transfers``) is
one request's KV on one (prefill rank, decode rank) pair: the bytes this rank queued for it,
and the seconds from its first chunk being queued until every send of the request was idle on
this rank; ``ok`` is False when the connector reported a failure.
"""

from __future__ import annotations

import threading
import time

from rank.messages import TransferRecord

# Records kept between two status polls at most (oldest dropped first).
MAX_RECORDS = 10_000


class TransferLog:
    """Accumulates per-pair bytes while a request's chunks are queued; closes on idle."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[float, dict[str, int]]] = {}
        self._done: list[TransferRecord] = []
        self._lock = threading.Lock()

    def add(self, request_id: str, pair: str, nbytes: int) -> None:
        """Count ``nbytes`` queued for ``request_id`` on ``pair``."""
        with self._lock:
            start, pairs = self._open.setdefault(request_id, (time.monotonic(), {}))
            pairs[pair] = pairs.get(pair, 0) + nbytes

    def close(self, request_id: str, ok: bool) -> None:
        """The request's sends are idle: turn its counts into records."""
        with self._lock:
            entry = self._open.pop(request_id, None)
            if entry is None:
                return
            seconds = time.monotonic() - entry[0]
            self._done.extend(TransferRecord(p, n, seconds, ok) for p, n in entry[1].items())
            del self._done[:-MAX_RECORDS]

    def take(self) -> tuple[TransferRecord, ...]:
        """Closed records since the last call."""
        with self._lock:
            out, self._done = tuple(self._done), []
            return out

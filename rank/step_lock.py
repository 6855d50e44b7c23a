"""The leader's lock, fair to actor calls: a call waiting for it goes in between two steps.

The loop thread holds :attr:`rank.leader.Leader.lock` for a whole step and takes it again
right after; a plain lock then lets an actor call (a new request's ``generate`` / ``prefill``,
a ``reserve``) wait through several steps, since the loop thread gets the lock back before
the waiting thread wakes. That wait lies on the new request's way to its first token (issue
36). :meth:`StepLock.give_way`, called by the loop before it takes the lock for a step, waits
(bounded) until no call is waiting for the lock.
"""

from __future__ import annotations

import threading

GIVE_WAY_S = 0.05  # most the loop waits for calls between two steps, seconds


class StepLock:
    """A re-entrant lock (``with lock:``) that counts the threads waiting for it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0

    def __enter__(self) -> StepLock:
        if not self._lock.acquire(blocking=False):
            with self._cond:
                self._waiting += 1
            try:
                self._lock.acquire()
            finally:
                with self._cond:
                    self._waiting -= 1
                    self._cond.notify_all()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def give_way(self, timeout_s: float = GIVE_WAY_S) -> bool:
        """Wait until no thread waits for the lock (at most ``timeout_s`` seconds; the caller
        must not hold it). True when none waits any more."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting == 0, timeout_s)

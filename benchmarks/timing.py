"""How the benchmarks time a call: the best of several runs after a warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], repeats: int,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Best time of ``repeats`` calls of ``fn`` on ``clock`` (default wall;
    ``time.thread_time``: this thread's CPU seconds, which other jobs on a shared machine
    move little), seconds, after one warm-up call (so first-call costs such as allocation
    and kernel selection are left out)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best

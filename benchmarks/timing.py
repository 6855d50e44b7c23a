"""How the benchmarks time a call: the best of several runs after a warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``fn``, seconds, after one warm-up call (so
    first-call costs such as allocation and kernel selection are left out)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best

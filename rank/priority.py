"""Rank processes at the scheduler's normal priority.

Ray starts its worker processes, the rank actors among them, at nice 15 (the raylet's
``worker_niceness``), while the router, the clients and Ray's own daemons run at nice 0. On a
small machine those then win the cores from the ranks: the forward, the step loop and the
event stream's sender wait behind them (issue 36). With ``ORCH_RANK_NICE`` set (e.g. 0), a
rank sets every thread of its process to that value when it starts. It is opt-in: where the
ranks outnumber the cores, ranks at nice 0 also starve Ray's own daemons and the router, and
health pings time out (CI's chaos test saw every instance miss one at once). Lowering a nice
value needs CAP_SYS_NICE (root has it): without it the rank keeps Ray's value and says so once.

NOTE: a Linux nice value belongs to a thread; threads started later inherit their starter's,
so every thread that exists now is set (``/proc/self/task``).
"""

from __future__ import annotations

import logging
import os

from engine.envs import ORCH_RANK_NICE

log = logging.getLogger(__name__)

def raise_priority(nice: int | None = None) -> bool:
    """Set every thread of this process to ``nice`` when it is lower (better) than theirs.
    Returns True when every thread runs at ``nice`` or better afterwards; False (logged at
    warning) when the process may not lower its nice value (no CAP_SYS_NICE) or a thread
    could not be set. ``nice`` None: ``ORCH_RANK_NICE``, and when that is unset nothing is
    changed (True). Never raises (a bad ``ORCH_RANK_NICE`` is logged and ignored)."""
    if nice is None:
        try:
            nice = ORCH_RANK_NICE.get()
        except ValueError as exc:
            log.warning("%s", exc)
            return False
        if nice is None:
            return True
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # NOTE: no procfs (not Linux): the process as a whole
        tids = [0]
    ok = True
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # NOTE: the thread ended meanwhile
        except OSError as exc:
            ok = False
            log.warning("rank process %d stays at nice %d (could not set nice %d: %s); "
                        "start Ray with RAY_worker_niceness=%d, or grant CAP_SYS_NICE",
                        os.getpid(), os.getpriority(os.PRIO_PROCESS, 0), nice, exc, nice)
            break
    return ok

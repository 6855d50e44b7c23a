"""rank/step_lock.py: an actor call waiting for the leader's lock gets it at the end of the
step in progress, not after several steps (issue 36: a new request's call waited there)."""

from __future__ import annotations

import threading
import time

from rank.step_lock import StepLock

STEP_S = 0.01


def _steps_waited(fair: bool) -> list[int]:
    """Steps that ended while each of 5 calls waited for the lock."""
    lock, stop, steps = StepLock(), threading.Event(), [0]

    def loop() -> None:
        while not stop.is_set():
            if fair:
                lock.give_way()
            with lock:
                time.sleep(STEP_S)  # a step holds the lock for its whole length
                steps[0] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    waited = []
    try:
        for _ in range(5):
            time.sleep(STEP_S / 3)
            before = steps[0]
            with lock:
                waited.append(steps[0] - before)
    finally:
        stop.set()
        thread.join(5)
    return waited


def test_a_waiting_call_goes_in_at_the_end_of_the_step_in_progress():
    assert max(_steps_waited(fair=True)) <= 1


def test_give_way_is_bounded_and_the_lock_reentrant():
    lock = StepLock()
    with lock:
        with lock:  # re-entrant, as the leader's RLock was
            pass
    assert lock.give_way(0.01)  # nobody waits

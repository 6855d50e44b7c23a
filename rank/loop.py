"""The leader's loop thread: the role's step, again and again, until shutdown.

After each iteration the leader flushes its events (one frame per router, rank/event_stream.py).
An iteration that did work is followed by the next at once; an idle one first runs the rank's
``on_idle`` (DeepSeek-V4: every rank frees what ended requests released, which a step would do
first, but an idle instance takes none), then waits for the leader's wake event (a new request,
an admitted first token, a status report, a router subscribing, shutdown) or a bound: 5 ms while
requests are on the instance (KV arrival, draining sends and deadlines are polled) or it steps
in DP lockstep, else :data:`PARK_S` or until the next heartbeat frame is due, whichever comes
first (an idle iteration costs ~75 us of CPU; at 5 ms an idle leader's ticks took a core's
share from, and preempted, the busy ranks on a small machine). The loop never ends on
an error: a :class:`~rank.failures.RankFailure` takes the instance out of service (the next
iterations end every request with an error event), any other error of a step ends every
request of the instance and the loop goes on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rank.failures import RankFailure
from rank.leader import Leader
from rank.role import Role

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005
PARK_S = 0.05


class StepLoop:
    """The loop thread of one leader.

    Args:
        name: the instance's name (thread name, log lines).
        leader: the leader's state (wake event, out-of-service state, step timer).
        role: the role whose ``step`` each iteration runs.
        on_idle: run (loop thread, between steps) after an iteration that did no work; may
            raise as a step does (``rank.rank.Rank.free_idle_releases``).
    """

    def __init__(self, name: str, leader: Leader, role: Role,
                 on_idle: Callable[[], None] = lambda: None) -> None:
        self.name, self.leader, self.role = name, leader, role
        self.on_idle = on_idle
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (bounded by ``timeout_s``: a step in progress ends first)."""
        self._stop.set()
        self.leader.wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        wake = self.leader.wake
        while not self._stop.is_set():
            worked = self._iterate()
            self._flush()
            if not worked:
                wake.wait(self._idle_wait_s())
                wake.clear()
        try:
            self.leader.leave_lockstep()  # NOTE: in this thread: never beside a round
        except Exception:  # noqa: BLE001 - stopping goes on
            log.exception("%s: leaving the DP lockstep failed", self.name)

    def _idle_wait_s(self) -> float:
        """The bound of an idle iteration's wait (module docstring); never raises."""
        try:
            if self.role.num_active() or self.leader.in_lockstep:
                return IDLE_WAIT_S
            due = self.leader.stream.beat_due_in()
        except Exception:  # noqa: BLE001 - the loop lives on: poll as when busy
            log.exception("%s: reading the idle state failed", self.name)
            return IDLE_WAIT_S
        return PARK_S if due is None else min(PARK_S, max(IDLE_WAIT_S, due))

    def _flush(self) -> None:
        """The iteration's events to the routers; never raises."""
        try:
            self.leader.flush_events()
        except Exception:  # noqa: BLE001 - the loop lives on
            log.exception("%s: sending events failed", self.name)

    def _iterate(self) -> bool:
        """One loop iteration; never raises (an error ends requests, never the loop). True
        when it did work."""
        leader = self.leader
        try:
            if leader.broken is not None:
                if self.role.num_active():
                    self.role.fail_all(str(leader.out_of_service()))
                return False
            started = time.perf_counter()
            try:
                worked = self.role.step()
            finally:
                leader.step_timer.end_step(time.perf_counter() - started)
            if not worked:
                self.on_idle()
            return worked
        except RankFailure as exc:
            leader.mark_broken(str(exc))
            return True
        except Exception as exc:  # noqa: BLE001 - not a rank's failure: the step's requests
            log.exception("%s: step failed", self.name)
            try:
                self.role.fail_all(f"{self.name}: step failed: {exc}")
            except Exception:  # noqa: BLE001
                log.exception("%s: failing the requests of a failed step failed", self.name)
            return False

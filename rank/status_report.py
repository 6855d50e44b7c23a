"""The leader's status on its token stream: one thread that takes a snapshot every period.

The router's status board reads these reports instead of calling every leader over Ray each
second (orchestrator/status.py), and a snapshot whose call reached every rank tells the
router's health monitor that they were all alive then (``Leader.ranks_alive``), so it skips its
Ray pings of them. The snapshot (``Rank.status``) asks the followers with its own bounds: a
hung one makes it raise after them, and the report is skipped (the monitor, no longer hearing
that the ranks live, pings them).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from rank.leader import Leader
from rank.messages import InstanceStatusInfo
from rank.status_row import status_row

log = logging.getLogger(__name__)


class StatusReporter:
    """Every ``period_s`` (the shortest any router asked for): ``status()`` onto the stream.

    Args:
        name: the instance's name (thread name, logs).
        leader: whose stream carries the reports, and who hears that the ranks are alive.
        status: the snapshot (``Rank.status``); may raise (a rank hung: no report this time).
    """

    def __init__(self, name: str, leader: Leader,
                 status: Callable[[], InstanceStatusInfo]) -> None:
        self.name, self._leader, self._status = name, leader, status
        self._period_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def every(self, period_s: float) -> None:
        """Report at least every ``period_s`` seconds from now on (starts the thread)."""
        self._period_s = min(period_s, self._period_s or period_s)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-status",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (bounded: a snapshot in progress ends first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.report_once()

    def report_once(self) -> None:
        """One snapshot onto the stream; never raises."""
        began = time.monotonic()
        try:
            status = self._status()
        except Exception as exc:  # noqa: BLE001 - a hung or failing rank: no report now
            log.debug("%s: no status report: %s", self.name, exc)
            return
        if status.broken is None and status.ranks:
            self._leader.ranks_alive(began)
        try:
            self._leader.stream.set_status(status_row(status))
        except Exception:  # noqa: BLE001 - the thread lives on
            log.exception("%s: encoding the status failed", self.name)
        self._leader.wake.set()  # NOTE: the loop's next flush sends it

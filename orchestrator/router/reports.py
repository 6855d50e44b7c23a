"""What the instances report about themselves on their token streams, as the router last heard it.

Every frame of a leader's stream (orchestrator/router/event_stream.py) says how long ago every
rank of its instance was last known alive (a step ran on all of them, or they all answered a
status snapshot) and, about once per ``status_s``, carries the leader's status. The event pump
writes them here; the health monitor (orchestrator/deploy/health.py) pings over Ray only an
instance not heard alive within its probe interval, and the status board (orchestrator/status.py)
shows the latest status instead of calling every leader each second. A stream lost is told to
``on_lost`` (the monitor probes that instance at once).

NOTE: a frame is dated when it arrives, less the age the leader wrote in it: frames a router
reads late (a backlog in its socket) look younger than they are by that backlog.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from rank.messages import InstanceStatusInfo

# The leaders' reporting periods the router asks for (seconds).
STATUS_S = 1.0  # the status board's refresh


class InstanceReports:
    """Instance name -> when it was last heard alive, and its latest status (router loop only).

    Args:
        beat_s: the heartbeat each leader is asked for (seconds; None: none asked).
        status_s: the status report period asked for (seconds; None: none asked).
    """

    def __init__(self, beat_s: float | None = None, status_s: float | None = STATUS_S) -> None:
        self.beat_s, self.status_s = beat_s, status_s
        self._alive_at: dict[str, float] = {}  # name -> time.monotonic()
        self._status: dict[str, tuple[float, InstanceStatusInfo]] = {}  # name -> (at, status)
        self.on_lost: Callable[[str], None] | None = None

    def heard(self, name: str, ranks_age_s: float | None,
              status: InstanceStatusInfo | None) -> None:
        """One frame of ``name``'s stream arrived (the event pump, per frame)."""
        if ranks_age_s is None and status is None:
            return
        now = time.monotonic()
        if ranks_age_s is not None:
            at = now - ranks_age_s
            if at > self._alive_at.get(name, 0.0):
                self._alive_at[name] = at
        if status is not None:
            old = self._status.get(name)
            if old is not None and old[1].transfers:  # NOTE: not shown yet: keep its records
                status = replace(status, transfers=old[1].transfers + status.transfers)
            self._status[name] = (now, status)

    def lost(self, name: str) -> None:
        """``name``'s stream is lost: nothing heard before counts any more."""
        self._alive_at.pop(name, None)
        self._status.pop(name, None)
        if self.on_lost is not None:
            self.on_lost(name)

    def alive_at(self, name: str) -> float | None:
        """``time.monotonic()`` when every rank of ``name`` was last heard alive, or None."""
        return self._alive_at.get(name)

    def take_status(self, name: str, max_age_s: float) -> InstanceStatusInfo | None:
        """``name``'s latest status if it arrived within ``max_age_s`` seconds, else None.
        Its transfer records are handed out once: later takes of the same report have none."""
        entry = self._status.get(name)
        if entry is None or time.monotonic() - entry[0] > max_age_s:
            return None
        at, status = entry
        if status.transfers:
            self._status[name] = (at, replace(status, transfers=()))
        return status

"""A router replica's copy of the first replica's health monitor (``router.replicas`` > 1).

Only the first replica probes the ranks and restarts instances (one prober, one restarter);
every change of its :class:`HealthMonitor` is pushed to the other replicas as rows
(:func:`health_rows`), which a :class:`HealthMirror` applies: its policies, placement waits and
gRPC health then read the same states as the first replica's. A placement's probe and a failure
a replica saw go to the first replica's monitor over the peer channel
(orchestrator/router/peers.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from orchestrator.deploy.background import Background
from orchestrator.deploy.health import Health, HealthMonitor, InstanceHealth
from orchestrator.router.peers import PeerClient

log = logging.getLogger(__name__)
# [name, role, state, reason, retry_at, returning] per instance
HealthRow = list


def health_rows(monitor: HealthMonitor) -> list[HealthRow]:
    """Every instance's health as it travels to the replicas."""
    return [[h.name, h.role, h.state.value, h.reason, h.retry_at, monitor.returning(h.name)]
            for h in monitor.snapshot()]


class HealthMirror(HealthMonitor):
    """:class:`HealthMonitor`'s queries and listeners over states pushed from the first
    replica (:meth:`apply`); it probes nothing itself.

    Args:
        rows: the first replica's :func:`health_rows` now.
        main: the first replica's peer channel (probes, failures seen here).
        probe_interval_s: ``health.probe_interval_s`` (its Retry-After floor).
        on_unhealthy: ``(name, reason)`` when a healthy instance turns unhealthy (the replica's
            router fails the requests watching it).
    """

    def __init__(self, rows: list[HealthRow], main: PeerClient, probe_interval_s: float,
                 on_unhealthy: Callable[[str, str], None] | None = None) -> None:
        super().__init__({row[0]: row[1] for row in rows}, ranks_of=lambda name: [],
                         probe_interval_s=probe_interval_s, probe_timeout_s=probe_interval_s)
        self.main = main
        self._mirror_unhealthy = on_unhealthy
        self._returning: set[str] = set()
        self._calls = Background("a failure report to the first replica")
        self.apply(rows)

    def apply(self, rows: list[HealthRow]) -> None:
        """Take the first replica's states (listeners hear of every change)."""
        seen = set()
        for name, role, state, reason, retry_at, returning in rows:
            seen.add(name)
            old = self._states.setdefault(name, InstanceHealth(name, role, Health.STARTING))
            (self._returning.add if returning else self._returning.discard)(name)
            self._set(name, Health(state), reason, retry_at)
            if (old.state is Health.HEALTHY and Health(state) in (Health.UNHEALTHY,
                                                                  Health.RECOVERING)
                    and self._mirror_unhealthy is not None):
                self._mirror_unhealthy(name, reason)
        for name in set(self._states) - seen:
            old = self._states.pop(name)
            self._notify(InstanceHealth(name, old.role, Health.DRAINING, "removed"))

    def returning(self, name: str) -> bool:
        return self._states[name].state is not Health.HEALTHY and name in self._returning

    def start(self) -> None:
        """Nothing to probe: the first replica does."""

    async def stop(self, timeout_s: float = 5.0) -> None:
        await self._calls.wait(timeout_s)

    async def probe(self, name: str) -> str | None:
        """The first replica's probe of ``name``; None (no verdict) when it cannot be asked."""
        try:
            return await self.main.call("probe", name)
        except ConnectionError as exc:
            log.warning("probe of %s: %s", name, exc)
            return None

    def report_failure(self, name: str, reason: str) -> None:
        """Tell the first replica's monitor (its verdict comes back with the next push)."""
        self._calls.start(self.main.call("failure", name, reason))

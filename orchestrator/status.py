"""What `orch status` and the metrics show per instance: health plus load, always bounded.

:class:`InstanceView` is one row (also the client-side value of ``GetStatus``; no torch or Ray
here). :class:`StatusBoard` builds the rows on the router: the monitor's cached health, and for
each healthy instance its leader's ``status()`` bounded by ``health.status_timeout_s`` (an
unhealthy one is not asked: a hung rank would only make the answer late). A leader whose own
status says it is broken, or whose status call fails while a ping of its ranks fails too, is
reported to the monitor, and the row shows the monitor's state after that: the monitor is the
one source of an instance's health.

The 1 s refresh (:meth:`StatusBoard.report`, the metrics) reads the statuses the leaders report
on their token streams (orchestrator/router/reports.py) and calls over Ray only a leader whose
report is missing or stale; ``GetStatus`` (:meth:`StatusBoard.views`) asks every leader afresh.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rank.messages import InstanceStatusInfo
from orchestrator.deploy.health import HealthMonitor
from orchestrator.router.leader import LeaderClient, LeaderError
from orchestrator.router.reports import InstanceReports

log = logging.getLogger(__name__)
# A status report older than this many report periods is stale: the leader is asked over Ray.
REPORT_STALE = 2.5
# NOTE: the InstanceStatusInfo field in which a leader says it is out of service ("" = fine);
# read with getattr so that leaders without it count as fine.


@dataclass(frozen=True)
class InstanceView:
    """One instance as `orch status` shows it.

    Attributes:
        name, role, tp: from the deployment (known even when the instance does not answer).
        health: "healthy", "unhealthy", "recovering", "starting" or "draining"
            (``orchestrator.deploy.health.Health``).
        detail: why it is not healthy, or why its status is missing ("" otherwise).
        status: the leader's snapshot; None when it was not asked or did not answer.
        router_tokens: tokens this router (replica) placed on the instance and has not
            released (its policy's ``outstanding``: the load it places by); known whether or
            not the instance answered. With ``router.replicas`` > 1, this replica's only.
    """

    name: str
    role: str
    tp: int
    health: str
    detail: str = ""
    status: InstanceStatusInfo | None = None
    router_tokens: int = 0

    @property
    def healthy(self) -> bool:
        return self.health == "healthy"


class InstanceMetrics(Protocol):
    """The part of the router's metrics the board feeds (``RouterMetrics``, ``NoMetrics``)."""

    def update_instances(self, statuses: list[InstanceStatusInfo]) -> None: ...


class StatusBoard:
    """Bounded instance rows for ``GetStatus`` and the metrics reporter (router loop only).

    Args:
        leaders: every instance leader now (asked at every call: instances come and go).
        tps: role -> tp of its instances.
        monitor: the :class:`orchestrator.deploy.health.HealthMonitor` of those instances.
        metrics: gets ``update_instances(statuses)`` with every set of answers (each answer's
            transfer records arrive once, so every status call must pass through here).
        status_timeout_s: bound of one leader's ``status()`` (seconds).
        reports: the leaders' own status reports (None: every refresh calls every leader).
        pools: the router's policies, role -> policy (``Flow.pools``), whose ``outstanding``
            tokens per instance fill ``InstanceView.router_tokens`` (None: 0).
    """

    def __init__(self, leaders: Callable[[], list[LeaderClient]], tps: dict[str, int],
                 monitor: HealthMonitor,
                 metrics: InstanceMetrics, status_timeout_s: float,
                 reports: InstanceReports | None = None,
                 pools: Callable[[], Mapping[str, Any]] | None = None) -> None:
        self.leaders, self.tps, self.monitor = leaders, tps, monitor
        self.metrics, self.status_timeout_s = metrics, status_timeout_s
        self.reports, self.pools = reports, pools

    async def views(self, reported: bool = False) -> list[InstanceView]:
        """One row per instance, in leader order, then those still starting; returns within
        ``status_timeout_s`` (twice that when a status call fails and the instance's ranks are
        pinged, below) plus scheduling time, whatever the instances do. ``reported``: a
        leader's report younger than ``REPORT_STALE`` report periods stands for its answer."""
        leaders = self.leaders()
        known = {leader.name for leader in leaders}
        views = list(await asyncio.gather(*(self._view(l, reported) for l in leaders)))
        views += [InstanceView(h.name, h.role, self.tps[h.role], h.state.value, h.reason)
                  for h in self.monitor.snapshot() if h.name not in known]
        self.metrics.update_instances([v.status for v in views if v.status is not None])
        load = self.router_load()
        return [dataclasses.replace(v, router_tokens=load.get(v.name, 0)) for v in views]

    def router_load(self) -> dict[str, int]:
        """Instance -> tokens the router's policies have placed there and not released
        (empty without ``pools``)."""
        if self.pools is None:
            return {}
        return {name: tokens for policy in self.pools().values()
                for name, tokens in policy.outstanding.items()}

    async def report(self, period_s: float) -> None:
        """Forever: refresh the metrics (and broken-leader reports) every ``period_s``."""
        while True:
            try:
                await self.views(reported=True)
            except Exception:  # noqa: BLE001 -- the reporter must outlive any one failure
                log.exception("instance status report failed")
            await asyncio.sleep(period_s)

    async def _view(self, leader: LeaderClient, reported: bool) -> InstanceView:
        health = self.monitor.get(leader.name)
        row = dict(name=leader.name, role=leader.role, tp=self.tps[leader.role],
                   health=health.state.value)
        if health.reason:
            return InstanceView(**row, detail=health.reason)
        status = self._reported(leader.name) if reported else None
        try:
            status = status or await leader.status(timeout_s=self.status_timeout_s)
        except LeaderError as exc:
            return InstanceView(**{**row, **await self._unanswered(leader.name, exc)})
        if status.broken:
            self.monitor.report_failure(leader.name, f"its leader says: {status.broken}")
            health = self.monitor.get(leader.name)
            return InstanceView(**{**row, "health": health.state.value}, detail=health.reason,
                                status=status)
        return InstanceView(**row, status=status)

    def _reported(self, name: str) -> InstanceStatusInfo | None:
        """``name``'s latest status report if it is recent, else None."""
        if self.reports is None or self.reports.status_s is None:
            return None
        return self.reports.take_status(name, REPORT_STALE * self.reports.status_s)

    async def _unanswered(self, name: str, exc: LeaderError) -> dict[str, str]:
        """Health and detail of ``name`` whose status call failed: its ranks are pinged at
        once (bounded by ``status_timeout_s``) and a failed ping goes to the monitor, so the
        row shows the monitor's verdict (one source of truth), never "healthy" beside a
        detail saying a rank is gone."""
        try:
            failure = await asyncio.wait_for(self.monitor.probe(name), self.status_timeout_s)
        except asyncio.TimeoutError:
            self.monitor.probe_soon(name)
            return dict(health=self.monitor.get(name).state.value, detail=(
                f"no status: {exc}; its ranks did not answer pings within "
                f"{self.status_timeout_s:g} s either (the health monitor marks it unhealthy "
                "once they stay silent for health.probe_timeout_s)"))
        if failure is not None:
            self.monitor.report_failure(name, failure)
            health = self.monitor.get(name)
            return dict(health=health.state.value, detail=health.reason)
        return dict(health=self.monitor.get(name).state.value,
                    detail=f"no status: {exc} (every rank answers pings: busy, not gone)")

"""Waiting for an instance that is being brought back, instead of failing the request.

A placement needs a healthy instance of every role of its flow (``Flow.pools``). When a role
has none but one of its instances is being restarted (``HealthView.returning``: a restart of
it runs or is scheduled), :meth:`Availability.wait` holds the request until one is healthy
again, its deadline passes, it is aborted or the router shuts down. Nothing polls: the health
monitor calls :meth:`Availability.changed` on every state change, which wakes every waiter at
once. When no instance of the role can come back (recovery off, restarts used up) the request
fails at once, UNAVAILABLE, naming each instance's reason.

A retry whose only healthy candidates of a role are instances that already failed it (the
monitor has not noticed yet: a killed rank fails the request's poll at once, the next probe
comes up to ``health.probe_interval_s`` later) first has them probed: one probe per instance
shared by every waiting request, a failed one reported to the monitor (which restarts the
instance, and the retry waits for that), a passed one lets the retry go ahead on it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Collection, Protocol

from orchestrator.router.policies import Policy
from orchestrator.router.request import RequestError

log = logging.getLogger(__name__)


class HealthView(Protocol):
    """What placement needs of the health monitor (``orchestrator.deploy.health.HealthMonitor``
    implements it); every method is called on the router's loop."""

    def is_healthy(self, name: str) -> bool:
        """May new requests go to ``name`` now?"""

    def returning(self, name: str) -> bool:
        """Is ``name`` out of service while a restart of it runs or is scheduled?"""

    def get(self, name: str) -> Any:
        """``name``'s health; its ``reason`` says why it is out of service."""

    async def probe(self, name: str) -> str | None:
        """Ping every rank of ``name`` once (bounded); None when all answered, else why not."""

    def report_failure(self, name: str, reason: str) -> None:
        """``name`` failed: a healthy instance turns unhealthy (and is restarted)."""

    def add_listener(self, listener: Any) -> None:
        """Call ``listener(health)`` after every state change."""

    def remove_listener(self, listener: Any) -> None:
        """Stop calling ``listener``."""


class Availability:
    """Holds placements while a needed role's instances are all being brought back.

    Args:
        health: the health monitor (None: no instance ever comes back, nothing waits).
    """

    def __init__(self, health: HealthView | None = None) -> None:
        self._health = health
        self._changed: asyncio.Future[None] | None = None  # done at the next state change
        self._closed: RequestError | None = None
        self._probes: dict[str, asyncio.Task] = {}  # instance -> its shared probe, running
        if health is not None:
            health.add_listener(self.changed)

    def changed(self, _health: object = None) -> None:
        """Some instance changed state (the monitor's listener): every waiter looks again."""
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    def close(self, error: RequestError) -> None:
        """Shutdown: every wait, now and later, raises ``error``; stop listening."""
        self._closed = error
        if self._health is not None:
            self._health.remove_listener(self.changed)
        for probe in self._probes.values():
            probe.cancel()
        self.changed()

    async def wait(self, pools: dict[str, Policy], deadline: float, woken: asyncio.Future,
                   avoid: Collection[str] = ()) -> None:
        """Return once every role in ``pools`` (role -> its policy) has an instance its
        policy may choose, or at once when ``woken`` (the request's abort mark) is done.
        Healthy instances in ``avoid`` (they failed this request) that are all its role
        has are probed first (see the module docstring).

        Raises:
            RequestError: UNAVAILABLE when a role has no healthy instance and none of them
                is coming back, when ``deadline`` (``time.monotonic()`` seconds) passes while
                waiting for one, or when the router shuts down (:meth:`close`).
        """
        probed: set[str] = set()
        while True:
            if self._closed is not None:
                raise self._closed
            if woken.done():
                return
            suspects = {n for p in pools.values() for n in _only_avoided(p, avoid)} - probed
            if suspects and self._health is not None:
                probed |= suspects
                await self._probe_all(suspects, deadline, woken)
                continue
            missing = [(role, p) for role, p in pools.items() if not _any_healthy(p)]
            if not missing:
                return
            lost = self.lost_role(pools)
            if lost is not None:
                raise lost
            role, policy = missing[0]
            returning = [n for n in policy.instances if self._returning(n)]
            if not any(self._back_in_time(n, deadline) for n in returning):
                raise RequestError("UNAVAILABLE", f"no healthy {role} instance "
                                   f"({', '.join(policy.instances)} out of service) and no "
                                   "restart of one is due before this request's deadline "
                                   f"(router.request_timeout_s) ({self._reasons(policy)}): "
                                   "retry after the time named; `orch status` shows why")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError("UNAVAILABLE", f"no healthy {role} instance within "
                                   f"router.request_timeout_s: still being restarted "
                                   f"({self._reasons(policy)}): retry later")
            if self._changed is None:
                self._changed = asyncio.get_running_loop().create_future()
            await asyncio.wait({self._changed, woken}, timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)

    def lost_role(self, pools: dict[str, Policy]) -> RequestError | None:
        """The UNAVAILABLE error when some role in ``pools`` has no healthy instance and none
        is coming back (recovery off, used up, failed); None otherwise."""
        for role, policy in pools.items():
            if not _any_healthy(policy) and not any(map(self._returning, policy.instances)):
                return RequestError("UNAVAILABLE", f"no healthy {role} instance "
                                    f"({', '.join(policy.instances)} out of service) and none "
                                    f"is being restarted ({self._reasons(policy)}): retry "
                                    "later; `orch status` shows why")
        return None

    async def _probe_all(self, names: set[str], deadline: float,
                         woken: asyncio.Future) -> None:
        """Until every probe of ``names`` ended, ``woken`` is done or ``deadline`` passed."""
        probes = {self._probes.get(n) or self._start_probe(n) for n in names}
        while not woken.done() and not all(p.done() for p in probes):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed is not None:
                return
            await asyncio.wait({*probes, woken}, timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)

    def _start_probe(self, name: str) -> asyncio.Task:
        task = self._probes[name] = asyncio.create_task(self._probe_one(name),
                                                        name=f"probe-after-failure-{name}")
        task.add_done_callback(lambda _: self._probes.pop(name, None))
        return task

    async def _probe_one(self, name: str) -> None:
        try:
            why = await self._health.probe(name)
        except Exception:  # noqa: BLE001 -- the waiters go on; the monitor's own probes stay
            log.exception("probing %s after a request failed on it failed", name)
            return
        if why is not None:  # NOTE: the monitor turns it unhealthy and restarts it
            self._health.report_failure(name, f"{why} (probed after a request failed on it)")

    def _returning(self, name: str) -> bool:
        return self._health is not None and self._health.returning(name)

    def _back_in_time(self, name: str, deadline: float) -> bool:
        """Whether ``name`` (returning) may be back before ``deadline`` (monotonic): its
        restart runs, or its next try (``retry_at``, wall clock) comes before the deadline."""
        retry_at = getattr(self._health.get(name), "retry_at", None)
        return retry_at is None or retry_at - time.time() < deadline - time.monotonic()

    def _reasons(self, policy: Policy) -> str:
        if self._health is None:
            return "no health monitor"
        return "; ".join(f"{name}: {self._health.get(name).reason or 'out of service'}"
                         for name in policy.instances)


def _any_healthy(policy: Policy) -> bool:
    return any(map(policy.healthy, policy.instances))


def _only_avoided(policy: Policy, avoid: Collection[str]) -> list[str]:
    """The healthy instances of ``policy`` when every one is in ``avoid``, else none."""
    healthy = [n for n in policy.instances if policy.healthy(n)]
    return healthy if all(n in avoid for n in healthy) else []

"""The router's side of the instance fleet: an instance that failed, one that joins, one that
is drained and removed, and what a health change means for the requests waiting.

:class:`Fleet` acts on the router's flow (placement), its event pump (the requests watching
each instance) and the requests in flight; the deploy layer calls it (the health monitor's
``on_unhealthy``, live scaling). Every method runs on the router's loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from orchestrator.router.availability import Availability
from orchestrator.router.flow import Flow
from orchestrator.router.event_pump import EventPump
from orchestrator.router.leader import LeaderClient

log = logging.getLogger(__name__)


class Fleet:
    """Fails, adds, drains and removes the instances one router serves on.

    Args:
        flow: the router's flow (its leaders and placement pools).
        pump: the router's event pump (which attempt watches which instance).
        availability: placements waiting for a role's instances to come back.
        watchers: the instance names each request in flight depends on (one set per
            request; read while draining).
        settle_s: seconds a drained instance's moved requests get to give its load back.
    """

    def __init__(self, flow: Flow, pump: EventPump, availability: Availability,
                 watchers: Callable[[], Iterable[set[str]]], settle_s: float) -> None:
        self.flow, self.pump, self.availability = flow, pump, availability
        self.watchers, self.settle_s = watchers, settle_s

    def instance_failed(self, name: str, reason: str) -> None:
        """``name`` is dead or hung (the health monitor says so): every request watching it
        fails now, without waiting for a poll to fail, and every call in flight to it fails
        now (a reserve on it tries the next decode). Before its first token a request is
        placed again elsewhere; after it, it migrates. Until it is restarted it is fenced
        (orchestrator/router/leader.py): its late events are dropped and no new work is sent
        to it.

        Raises:
            KeyError: ``name`` is no instance of this router.
        """
        leader = self.flow.leader(name)
        leader.fence(reason)  # NOTE: first: a late event or call must not reach it
        leader.abandon_calls(f"{name} failed: {reason}")
        told = self.pump.fail_instance(name, f"{name} failed: {reason}")
        log.info("%s failed (%s): %d request(s) still waiting on it were told", name, reason,
                 told)

    def health_changed(self, _health: object) -> None:
        """The health monitor's listener: the flow looks again; when a role is gone for good
        (no healthy instance, none coming back), requests waiting for decode room end now,
        UNAVAILABLE, rather than at their deadline."""
        self.flow.health_changed()
        # NOTE: on the next turn of the loop: a failure is told UNHEALTHY before the monitor
        # schedules the restart that makes it RECOVERING
        asyncio.get_running_loop().call_soon(self._fail_waiting_if_lost)

    def _fail_waiting_if_lost(self) -> None:
        lost = self.availability.lost_role(self.flow.pools)
        if lost is not None:
            ended = self.flow.fail_waiting(lost)
            if ended:
                log.info("%d request(s) waiting for decode room ended: %s", ended, lost.message)

    def add_instance(self, leader: LeaderClient) -> None:
        """Serve on a new instance too (live scaling; it is up): its events are followed from
        now on, and it is chosen once the health monitor says it is healthy."""
        self.flow.add_leader(leader)
        self.pump.add_leader(leader)

    async def drain_instance(self, name: str, timeout_s: float) -> int:
        """Wait until no request holds load on ``name`` (the caller has taken it out of
        service already, so no new one goes there), at most ``timeout_s`` seconds; then move
        the rest away: before their first token they are placed again, after it they
        migrate. Returns how many requests had to be moved.

        Raises:
            KeyError: ``name`` is no instance of this router.
            RuntimeError: load still on it ``settle_s`` seconds after moving them away.
        """
        leader = self.flow.leader(name)
        if await self._unloaded(name, timeout_s):
            return 0
        reason = f"{name} is being removed (drained for router.drain_timeout_s={timeout_s:g} s)"
        moved = self.pump.fail_instance(name, reason)
        leader.abandon_calls(reason)
        if not await self._unloaded(name, self.settle_s):
            raise RuntimeError(f"{name}: requests still hold load on it "
                               f"{self.settle_s:g} s after they were moved away")
        return moved

    async def remove_instance(self, name: str) -> None:
        """Forget a drained instance (:meth:`drain_instance`): no placement, no events.

        Raises:
            KeyError: no such instance. ValueError: load left on it, or the role's last.
        """
        leader = self.flow.remove_leader(name)
        await self.pump.remove_leader(name)
        await leader.close()

    async def _unloaded(self, name: str, timeout_s: float) -> bool:
        """Whether no request holds load on ``name`` within ``timeout_s`` seconds."""
        policy = next(p for p in self.flow.pools.values() if name in p.outstanding)
        deadline = time.monotonic() + timeout_s
        while policy.outstanding[name] > 0 or any(
                name in instances for instances in self.watchers()):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

"""Automatic recovery of a dead or hung instance (DP rank): restart it, rebind its client.

The health monitor (``orchestrator/deploy/health.py``) calls :meth:`Recoverer.recover` when an
instance turns unhealthy. The restart itself is :meth:`Cluster.restart_instance` (kill what
is left, new placement group, actors, TP group, start), run on a worker thread; then the
instance's :class:`~orchestrator.router.leader.LeaderClient` is rebound to the new leader, so the
EventPump and the flow reach it through the same client.

Expert-parallel roles: one EP group spans all instances of the role, so they restart together
(:meth:`Cluster.restart_group`); a recovery of any of them runs one restart of the group,
which the recoveries of the others (they break within ``step_timeout_s`` of the first, or
lose their ranks to the restart) wait for, and every client of the group is rebound.

Bounded restart rate: an instance restarted ``max_restarts`` times within ``window_s`` is not
restarted again until its oldest restart leaves the window (:meth:`Recoverer.restart_wait`
says how long; the health monitor waits that long, then tries again): a cause a restart does
not fix costs a restart per window, not a restart loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Protocol

from orchestrator.router.leader import LeaderClient

log = logging.getLogger(__name__)
_GRACE_S = 5.0  # beyond timeout_s before a restart thread is given up on


class Restartable(Protocol):
    """What the recoverer needs of the cluster (:class:`~orchestrator.deploy.cluster.Cluster`)."""

    def restart_group(self, name: str) -> list[str]:
        """The instances restarted together with ``name`` (``name`` first or not)."""

    def restart_instance(self, name: str, timeout_s: float) -> list[Any]:
        """Blocking; restarts :meth:`restart_group` of ``name`` and returns the new instances
        (``.cfg.name``, ``.leader``: its leader handle); raises on failure."""


class Recoverer:
    """Restarts unhealthy instances, at most ``max_restarts`` per instance per ``window_s``.

    Args:
        cluster: restarts an instance (:meth:`Cluster.restart_instance`).
        leaders: instance name -> the client the router uses for its leader (rebound).
        max_restarts: restarts allowed per instance within ``window_s`` (failed ones count).
        window_s: the sliding window of the restart rate, seconds.
        timeout_s: bound on one restart (placement, actors, model load, start), seconds.
    """

    def __init__(self, cluster: Restartable, leaders: dict[str, LeaderClient],
                 max_restarts: int = 3, window_s: float = 300.0,
                 timeout_s: float = 120.0) -> None:
        if max_restarts < 0 or window_s <= 0 or timeout_s <= 0:
            raise ValueError(f"Recoverer: max_restarts ({max_restarts}) must be >= 0, window_s "
                             f"({window_s}) and timeout_s ({timeout_s}) > 0")
        self._cluster, self._leaders = cluster, leaders
        self.max_restarts, self.window_s, self.timeout_s = max_restarts, window_s, timeout_s
        self._history: dict[str, deque[float]] = {}
        self._running: dict[str, asyncio.Task] = {}  # until its restart thread ended

    async def recover(self, name: str) -> bool:
        """Restart instance ``name``; True once it is back (its client rebound).

        A call while a restart of ``name`` runs waits for that one (never two at once).
        Returns False, logging one line saying why, when the restart rate is used up, the
        restart failed or did not finish within ``timeout_s``. Never raises (but
        ``CancelledError``; the restart itself goes on).
        """
        try:
            task = self._running.get(name)
            if task is None:
                refusal = self._refusal(name)
                if refusal is not None:
                    log.warning(refusal)
                    return False
                group = self._cluster.restart_group(name)
                task = asyncio.ensure_future(self._restart(name, group))
                for member in group:
                    self._history.setdefault(member, deque()).append(time.monotonic())
                    self._running[member] = task
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - recovery never takes the caller down
            log.warning("%s: recovery failed: %s: %s", name, type(exc).__name__, exc)
            return False

    def restarts(self, name: str) -> int:
        """Restarts of ``name`` within the last ``window_s``."""
        history = self._history.get(name, deque())
        cutoff = time.monotonic() - self.window_s
        while history and history[0] < cutoff:
            history.popleft()
        return len(history)

    def restart_wait(self, name: str) -> tuple[float, str] | None:
        """None when a restart of ``name`` may run now; else (seconds until the restart budget
        allows one, why not now). The health monitor's ``restart_wait``."""
        n = self.restarts(name)
        if n < self.max_restarts or n == 0:
            return None
        wait = self._history[name][0] + self.window_s - time.monotonic()
        return max(wait, 0.0), (f"restart budget used up: {n} restarts in the last "
                                f"{self.window_s:g} s (health.max_restarts="
                                f"{self.max_restarts} per health.restart_window_s)")

    def _refusal(self, name: str) -> str | None:
        """Why ``name`` must not be restarted now, or None."""
        if name not in self._leaders:
            return f"{name}: not restarted: no such instance (known: {sorted(self._leaders)})"
        wait = self.restart_wait(name)
        if wait is not None:
            return (f"{name}: not restarted now: {wait[1]}; the next restart may run in "
                    f"{wait[0]:.0f} s. If it keeps failing, find the cause in its ranks' "
                    "logs (docs/reliability.md, Logs); restarting `orch up` resets the budget")
        return None

    async def _restart(self, name: str, group: list[str]) -> bool:
        """One restart of ``name``'s ``group`` on a worker thread, bounded; ``_running`` of the
        group is cleared only when the thread ended (a late one must not overlap the next)."""
        started = time.monotonic()
        work = asyncio.ensure_future(
            asyncio.to_thread(self._cluster.restart_instance, name, self.timeout_s))
        try:
            insts = await asyncio.wait_for(asyncio.shield(work), self.timeout_s + _GRACE_S)
        except asyncio.TimeoutError:
            log.warning("%s: restart did not finish within %.0f s; it stays out of service "
                        "(see its ranks' worker-*.err in the rank log folder `orch up` printed)", name, self.timeout_s)
            return False
        except Exception as exc:  # noqa: BLE001 - BringUpError names the step and the fix
            log.warning("%s: restart failed: %s", name, exc)
            return False
        else:
            for inst in insts:
                self._leaders[inst.cfg.name].rebind(inst.leader)
            together = f" with {', '.join(n for n in group if n != name)}" \
                if len(group) > 1 else ""
            log.info("%s: restarted%s in %.1f s (restart %d in the last %g s)", name, together,
                     time.monotonic() - started, self.restarts(name), self.window_s)
            return True
        finally:  # NOTE: no await below: atomic on the loop
            if work.done():
                self._forget(group)
            else:
                work.add_done_callback(lambda _: self._forget(group))

    def _forget(self, group: list[str]) -> None:
        for member in group:
            self._running.pop(member, None)

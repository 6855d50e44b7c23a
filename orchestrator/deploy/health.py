"""Health of every instance (DP rank) as the router sees it: probes, states, recovery.

One asyncio task per instance pings every rank of it (``node_info``, a cheap actor method)
every ``health.probe_interval_s`` seconds, each ping bounded by ``health.probe_timeout_s``,
unless the instance's own reports (orchestrator/router/reports.py: its leader's token stream
says every rank was alive within the interval) make the ping moot: a serving instance costs no
Ray call, and one that falls silent (dead, hung, a lost stream) is pinged one interval after it
was last heard, so the bounds below hold as with pings alone:

- a rank whose actor is gone (``RayActorError``) turns the instance UNHEALTHY at once;
- a rank that does not answer within the bound (hung, e.g. SIGSTOP) turns it UNHEALTHY then;
- anyone may report a failure it saw (:meth:`HealthMonitor.report_failure`; the status board
  does when a leader's own status says it is broken).

States::

    HEALTHY --failure--> UNHEALTHY --recover given--> RECOVERING --recover True, probe ok--> HEALTHY
                                                                 --recover False/raised/probe
                                                                   fails--> UNHEALTHY
    UNHEALTHY (after a failed or deferred restart) --backoff delay--> RECOVERING (again)

A restart that fails, or that the restart budget defers (``restart_wait``), is tried again
after a delay that doubles from ``backoff_s`` up to ``backoff_max_s`` (and is never shorter
than the budget's own wait): an instance comes back by itself once its cause is gone. The
reason of a waiting instance names why and when the next try is (``InstanceHealth.retry_at``).

NOTE: an UNHEALTHY instance is not probed back to HEALTHY: a rank that missed a deadline may
have left its TP group or its KV pairs out of step (a zombie that answers pings yet fails every
request), so only a restart (the ``recover`` callback) returns it to service.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from engine.error_text import first_line
from orchestrator.router.reports import InstanceReports

log = logging.getLogger(__name__)
# NOTE: the probe's Ray concurrency group (one thread of its own on every rank actor, see
# orchestrator/deploy/cluster.py): a ping never queues behind calls that wait for the step lock
# while a long step runs (a graph capture on first use takes seconds on CPU).
PROBE_GROUP = "probe"


class Health(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    RECOVERING = "recovering"
    STARTING = "starting"  # added live (`orch scale`): not chosen until it is up
    DRAINING = "draining"  # being removed: not chosen, its requests finish or migrate


@dataclass(frozen=True)
class InstanceHealth:
    """One instance's health; ``reason`` says why it is not healthy ("" when healthy);
    ``retry_at``: wall-clock time (``time.time()``) of its next restart try, None when none is
    scheduled."""

    name: str
    role: str
    state: Health
    reason: str = ""
    retry_at: float | None = None


Listener = Callable[[InstanceHealth], None]
# name -> None when a restart may run now, else (seconds until it may, why not now)
RestartWait = Callable[[str], "tuple[float, str] | None"]


class HealthMonitor:
    """Probes every rank of every instance; runs on the router's event loop.

    Args:
        roles: instance name -> role, e.g. {"prefill-0": "prefill", "decode-0": "decode"}.
        ranks_of: instance name -> its CURRENT rank actor handles, rank order (asked before
            every probe, so handles that a restart replaced are picked up).
        probe_interval_s: seconds between two probes of one instance.
        probe_timeout_s: bound of one probe (seconds): a rank silent that long is hung.
        on_unhealthy: called ``(name, reason)`` the moment an instance turns unhealthy (the
            router fails over its requests); its errors are logged.
        recover: ``async (name) -> bool`` that restarts an instance; called once per turn to
            UNHEALTHY, bounded by ``recover_timeout_s``. None: unhealthy instances stay so.
        recover_timeout_s: bound of one ``recover`` call (seconds).
        backoff_s, backoff_max_s: delay before the first retry of a failed restart, and its
            cap (seconds); it doubles with every failed try in a row.
        restart_wait: asked before each try (the restart budget,
            :meth:`Recoverer.restart_wait`); None: a restart may always run.
        reports: the instances' own liveness reports (a probe is skipped while every rank of
            the instance was heard alive within ``probe_interval_s``; a lost stream is probed
            at once); None: every instance is pinged every interval.
    """

    def __init__(self, roles: dict[str, str], ranks_of: Callable[[str], list[Any]],
                 probe_interval_s: float, probe_timeout_s: float,
                 on_unhealthy: Callable[[str, str], None] | None = None,
                 recover: Callable[[str], Awaitable[bool]] | None = None,
                 recover_timeout_s: float = 600.0, backoff_s: float = 5.0,
                 backoff_max_s: float = 300.0, restart_wait: RestartWait | None = None,
                 reports: InstanceReports | None = None) -> None:
        self._ranks_of = ranks_of
        self._reports = reports
        if reports is not None:
            reports.on_lost = self.probe_soon
        self._interval_s, self._timeout_s = probe_interval_s, probe_timeout_s
        self._on_unhealthy, self._recover = on_unhealthy, recover
        self._recover_timeout_s = recover_timeout_s
        self._backoff_s, self._backoff_max_s = backoff_s, max(backoff_s, backoff_max_s)
        self._restart_wait = restart_wait or (lambda name: None)
        self._states = {name: InstanceHealth(name, role, Health.HEALTHY)
                        for name, role in roles.items()}
        self._listeners: list[Listener] = []
        self._tasks: list[asyncio.Task] = []
        self._recoveries: dict[str, asyncio.Task] = {}
        self._stopping = False
        self._wake = {name: asyncio.Event() for name in roles}  # probe now, or stop

    # ---- queries (any time, on the loop) -----------------------------------------------
    def get(self, name: str) -> InstanceHealth:
        return self._states[name]

    def is_healthy(self, name: str) -> bool:
        """The policies' predicate: may new requests go to ``name``?"""
        return self._states[name].state is Health.HEALTHY

    def returning(self, name: str) -> bool:
        """Is ``name`` out of service while a restart of it runs or is scheduled? The router
        holds requests for such an instance (``orchestrator/router/availability.py``); every
        change of this answer comes with a state change, so listeners hear of it."""
        return self._states[name].state is not Health.HEALTHY and name in self._recoveries

    def snapshot(self) -> list[InstanceHealth]:
        """Every instance's health, in the order given at construction."""
        return list(self._states.values())

    def roles_without_healthy(self) -> list[str]:
        """Roles none of whose instances is healthy (the service cannot serve then)."""
        roles = {h.role for h in self._states.values()}
        return sorted(r for r in roles if not any(
            h.role == r and h.state is Health.HEALTHY for h in self._states.values()))

    def capacity(self) -> dict[str, tuple[int, int]]:
        """role -> (healthy instances, instances): below all of them is reduced capacity."""
        out: dict[str, tuple[int, int]] = {}
        for h in self._states.values():
            healthy, total = out.get(h.role, (0, 0))
            out[h.role] = (healthy + (h.state is Health.HEALTHY), total + 1)
        return out

    def retry_after_s(self) -> float:
        """Seconds a client should wait before retrying while some role has no healthy
        instance: the soonest scheduled restart try of such a role (at least the probe
        interval, at least 1 s; the probe interval while a restart runs)."""
        now, waits = time.time(), [1.0]
        for role in self.roles_without_healthy():
            soonest = min((h.retry_at - now if h.retry_at is not None else self._interval_s)
                          for h in self._states.values() if h.role == role)
            waits.append(soonest)
        return max(max(waits), self._interval_s)

    def add_listener(self, listener: Listener) -> None:
        """``listener(health)`` is called after every state change (sync, on the loop)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener`` (no-op when it is not registered)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    # ---- live scaling (orchestrator/deploy/scaling.py) ------------------------------------
    def add_instance(self, name: str, role: str) -> None:
        """Know ``name`` (a new instance being brought up): STARTING, not probed yet.

        Raises:
            ValueError: ``name`` is known already.
        """
        if name in self._states:
            raise ValueError(f"instance {name} exists already")
        self._wake[name] = asyncio.Event()
        self._states[name] = InstanceHealth(name, role, Health.STARTING, "starting up")
        self._notify(self._states[name])

    def started(self, name: str) -> None:
        """``name`` is up: HEALTHY, probed from now on (call after :meth:`add_instance`)."""
        self._set(name, Health.HEALTHY, "")
        if not self._stopping:
            self._tasks.append(asyncio.create_task(self._watch(name), name=f"health-{name}"))

    def draining(self, name: str, reason: str) -> None:
        """``name`` is being removed: DRAINING (no new requests), no restart any more.

        Raises:
            KeyError: no instance ``name``.
        """
        recovery = self._recoveries.pop(name, None)
        if recovery is not None:
            recovery.cancel()
        self._set(name, Health.DRAINING, reason)

    def undrain(self, name: str) -> None:
        """A removal of ``name`` that failed: DRAINING -> HEALTHY (its probes never stopped;
        a failure they saw meanwhile stands)."""
        state = self._states.get(name)
        if state is not None and state.state is Health.DRAINING:
            self._set(name, Health.HEALTHY, "")

    def remove_instance(self, name: str) -> None:
        """Forget ``name`` (removed, or its start failed): no probe, no state; listeners
        hear of it once more (DRAINING, "removed") with it gone from :meth:`snapshot`."""
        recovery = self._recoveries.pop(name, None)
        if recovery is not None:
            recovery.cancel()
        self._wake.pop(name, asyncio.Event()).set()  # NOTE: its watch loop ends
        old = self._states.pop(name, None)
        if old is not None:
            self._notify(InstanceHealth(name, old.role, Health.DRAINING, "removed"))

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """One probing task per instance (call from the running loop)."""
        self._stopping = False
        for wake in self._wake.values():
            wake.clear()
        self._tasks = [asyncio.create_task(self._watch(name), name=f"health-{name}")
                       for name in self._states]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop probing and cancel running recoveries (bounded wait)."""
        self._stopping = True
        for wake in self._wake.values():
            wake.set()
        tasks = self._tasks + list(self._recoveries.values())
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout_s)
            if pending:
                log.warning("health tasks still running after stop: %s", pending)
        self._tasks, self._recoveries = [], {}

    # ---- failures ------------------------------------------------------------------------
    def report_failure(self, name: str, reason: str) -> None:
        """Someone saw ``name`` fail: a HEALTHY instance turns UNHEALTHY now (else no-op:
        an instance being restarted may still fail through its old handles, or removed)."""
        health = self._states.get(name)
        if health is not None and health.state is Health.HEALTHY:
            self._turn_unhealthy(name, reason)

    def probe_soon(self, name: str) -> None:
        """Probe ``name`` now rather than at its next turn (a call to it just failed)."""
        if name in self._wake:
            self._wake[name].set()

    async def probe(self, name: str) -> str | None:
        """Ping every rank of ``name`` once (bounded); None when all answered, else why not.

        A rank whose call raises ends the probe at once (others are not waited for).
        """
        try:
            handles = list(self._ranks_of(name))
        except Exception as exc:  # noqa: BLE001 -- a failed lookup is a failed probe
            return f"its rank handles are unavailable ({type(exc).__name__}: {exc})"
        tasks = [asyncio.ensure_future(_ping(handle)) for handle in handles]
        if not tasks:
            return "it has no rank actors"
        try:
            _, pending = await asyncio.wait(tasks, timeout=self._timeout_s,
                                            return_when=asyncio.FIRST_EXCEPTION)
        finally:  # NOTE: also when this probe is cancelled (stop)
            for task in tasks:
                task.cancel()
        errors = [f"rank {rank} {_describe(task.exception())}" for rank, task
                  in enumerate(tasks) if task.done() and not task.cancelled()
                  and task.exception() is not None]
        if errors:
            return "; ".join(errors)
        silent = [str(rank) for rank, task in enumerate(tasks) if task in pending]
        if silent:
            return (f"rank {', '.join(silent)} did not answer a ping within "
                    f"health.probe_timeout_s={self._timeout_s:g} s (hung or overloaded)")
        return None

    async def _watch(self, name: str) -> None:
        asked = False  # NOTE: probe_soon: ping even when the reports say it lives
        while not self._stopping and name in self._states:
            pause = self._interval_s
            heard = 0.0 if asked else self._heard_for(name)
            if self._states[name].state is Health.HEALTHY and heard <= 0.0:
                try:
                    failure = await self.probe(name)
                except Exception as exc:  # noqa: BLE001 -- the watch loop must not die
                    log.exception("probing %s failed", name)
                    failure = f"probe error {type(exc).__name__}: {exc}"
                if failure is not None:
                    self.report_failure(name, failure)
            elif heard > 0.0:
                pause = heard  # NOTE: ping once the last report is an interval old
            wake = self._wake.get(name)
            if wake is None:
                return
            try:
                await asyncio.wait_for(wake.wait(), pause)
            except asyncio.TimeoutError:
                pass
            asked = wake.is_set()
            wake.clear()

    def _heard_for(self, name: str) -> float:
        """Seconds until ``name``'s last report of live ranks is ``probe_interval_s`` old
        (<= 0: ping it now)."""
        at = None if self._reports is None else self._reports.alive_at(name)
        return -1.0 if at is None else at + self._interval_s - time.monotonic()

    def _turn_unhealthy(self, name: str, reason: str) -> None:
        shown = reason if self._recover else f"{reason}; automatic recovery is off: restart " \
                                               "`orch up`"
        self._set(name, Health.UNHEALTHY, shown)
        log.warning("%s is unhealthy: %s", name, reason)
        if self._on_unhealthy is not None:
            try:
                self._on_unhealthy(name, reason)
            except Exception:  # noqa: BLE001 -- the monitor goes on whatever the hook does
                log.exception("on_unhealthy(%s) failed", name)
        if self._recover is None:
            return
        self._set(name, Health.RECOVERING, f"restarting after: {reason}")
        self._recoveries[name] = asyncio.create_task(self._recover_one(name, reason),
                                                     name=f"recover-{name}")

    async def _recover_one(self, name: str, reason: str) -> None:
        """Restart ``name`` until it is back: after each failed or deferred try, UNHEALTHY
        with why and when the next try is, then RECOVERING again (cancelled by :meth:`stop`)."""
        for tries in itertools.count(1):
            wait = self._restart_wait(name)
            if wait is None:
                failure = await self._try_restart(name)
                if failure is None:
                    self._recoveries.pop(name, None)
                    self._set(name, Health.HEALTHY, "")
                    log.info("%s is healthy again after a restart", name)
                    return
                wait = (0.0, failure)
            backoff = self._backoff_s * 2 ** min(tries - 1, 32)  # NOTE: capped: no overflow
            delay = max(wait[0], min(self._backoff_max_s, backoff))
            retry_at = time.time() + delay
            shown = f"{reason}; {wait[1]}; next restart try in {delay:.0f} s (at " \
                    f"{time.strftime('%H:%M:%S', time.localtime(retry_at))})"
            self._set(name, Health.UNHEALTHY, shown, retry_at)
            log.warning("%s stays unhealthy: %s; next restart try in %.0f s", name, wait[1],
                        delay)
            await asyncio.sleep(delay)
            self._set(name, Health.RECOVERING, f"restart try {tries + 1} after: {reason}")

    async def _try_restart(self, name: str) -> str | None:
        """One ``recover(name)`` (bounded), then a probe: None when it is back, else why not."""
        try:
            ok = await asyncio.wait_for(self._recover(name), self._recover_timeout_s)
            return (await self.probe(name) if ok else
                    "the automatic restart failed or was refused (see the router log)")
        except asyncio.TimeoutError:
            return (f"the automatic restart did not finish within "
                    f"health.recover_timeout_s={self._recover_timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 -- a failed restart leaves it unhealthy
            log.exception("recovering %s failed", name)
            return f"the automatic restart raised {type(exc).__name__}: {exc}"

    def _set(self, name: str, state: Health, reason: str, retry_at: float | None = None) -> None:
        old = self._states[name]
        new = InstanceHealth(name, old.role, state, reason, retry_at)
        self._states[name] = new
        if new.state is not old.state:
            self._notify(new)

    def _notify(self, new: InstanceHealth) -> None:
        for listener in self._listeners:
            try:
                listener(new)
            except Exception:  # noqa: BLE001 -- a listener never stops the monitor
                log.exception("health listener %r failed", listener)


async def _ping(handle: Any) -> Any:
    # NOTE: ``Rank.node_info``: every rank has it, and it answers without touching the engine
    return await handle.node_info.options(concurrency_group=PROBE_GROUP).remote()


def _describe(exc: BaseException) -> str:
    """Why a ping raised, in a few words: a dead actor, or the error's first line."""
    from ray.exceptions import RayActorError  # ActorDiedError, ActorUnavailableError

    if isinstance(exc, RayActorError):
        return f"is gone ({type(exc).__name__})"
    return f"failed a ping ({first_line(exc, limit=200)})"

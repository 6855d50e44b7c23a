"""Availability without a server: waiters share one probe of an instance that failed them,
wake on state changes (no polling), end at once on an abort or close; and the monitor's
``returning`` answer through a restart, a failed restart and with recovery off."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from orchestrator.deploy.health import Health, HealthMonitor
from orchestrator.router.availability import Availability
from orchestrator.router.policies import RoundRobin
from orchestrator.router.request import RequestError
from tests.orchestrator.fakes import FakePrefill, Remote


class FakeHealth:
    """A HealthView whose states the test sets; counts probes; a failed probe's report
    starts a "restart" the test ends with :meth:`set`."""

    def __init__(self, names: list[str]) -> None:
        self.state = {name: "healthy" for name in names}
        self.probes: list[str] = []
        self.probe_answer: str | None = "rank 0 is gone"
        self.listeners: list = []
        self.retry_at: dict[str, float] = {}  # name -> wall-clock time of its next restart try

    def is_healthy(self, name: str) -> bool:
        return self.state[name] == "healthy"

    def returning(self, name: str) -> bool:
        return self.state[name] == "recovering"

    def get(self, name: str):
        return SimpleNamespace(reason=f"{name} is {self.state[name]}",
                               retry_at=self.retry_at.get(name))

    async def probe(self, name: str) -> str | None:
        self.probes.append(name)
        await asyncio.sleep(0.05)
        return self.probe_answer

    def report_failure(self, name: str, reason: str) -> None:
        self.set(name, "recovering")

    def set(self, name: str, state: str) -> None:
        self.state[name] = state
        for listener in list(self.listeners):
            listener(None)

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self.listeners.remove(listener)


def _pools(health: FakeHealth) -> dict:
    return {"prefill": RoundRobin(["p0"], health.is_healthy),
            "decode": RoundRobin(["d0"], health.is_healthy)}


def test_retries_share_one_probe_then_wait_for_the_restart():
    async def go():
        health = FakeHealth(["p0", "d0"])
        avail, pools = Availability(health), _pools(health)
        woken = asyncio.get_running_loop().create_future()
        deadline = time.monotonic() + 10
        waiters = [asyncio.create_task(avail.wait(pools, deadline, woken, avoid={"p0"}))
                   for _ in range(5)]
        await asyncio.sleep(0.2)
        assert health.probes == ["p0"]  # one probe for five requests
        assert health.state["p0"] == "recovering"  # found dead: reported
        assert not any(w.done() for w in waiters)
        health.set("p0", "healthy")
        await asyncio.wait_for(asyncio.gather(*waiters), 1)
        assert health.probes == ["p0"]
    asyncio.run(go())


def test_a_probe_that_passes_lets_the_retry_go_on_the_same_instance():
    async def go():
        health = FakeHealth(["p0", "d0"])
        health.probe_answer = None
        avail = Availability(health)
        woken = asyncio.get_running_loop().create_future()
        await asyncio.wait_for(avail.wait(_pools(health), time.monotonic() + 10, woken,
                                          avoid={"p0"}), 1)
        assert health.probes == ["p0"] and health.state["p0"] == "healthy"
    asyncio.run(go())


def test_abort_and_close_end_the_wait_at_once():
    async def go():
        health = FakeHealth(["p0", "d0"])
        health.state["p0"] = "recovering"
        avail, pools = Availability(health), _pools(health)
        loop = asyncio.get_running_loop()
        aborted, other = loop.create_future(), loop.create_future()
        first = asyncio.create_task(avail.wait(pools, time.monotonic() + 10, aborted))
        second = asyncio.create_task(avail.wait(pools, time.monotonic() + 10, other))
        await asyncio.sleep(0.05)
        aborted.set_result(None)
        await asyncio.wait_for(first, 1)  # returns: the router sees the abort mark
        assert not second.done()
        avail.close(RequestError("UNAVAILABLE", "shutting down"))
        with pytest.raises(RequestError, match="shutting down"):
            await asyncio.wait_for(second, 1)
        assert health.listeners == []
    asyncio.run(go())


def test_deadline_and_no_return_are_unavailable():
    async def go():
        health = FakeHealth(["p0", "d0"])
        health.state["d0"] = "recovering"
        avail, pools = Availability(health), _pools(health)
        woken = asyncio.get_running_loop().create_future()
        start = time.monotonic()
        with pytest.raises(RequestError, match="no healthy decode instance within"):
            await avail.wait(pools, start + 0.3, woken)
        assert 0.25 <= time.monotonic() - start < 1.0
        health.state["d0"] = "unhealthy"
        with pytest.raises(RequestError, match=r"\(d0 out of service\) and none is being "
                                               r"restarted \(d0: d0 is unhealthy\)"):
            await avail.wait(pools, time.monotonic() + 10, woken)
    asyncio.run(go())


def test_returning_through_a_restart_a_failed_one_and_with_recovery_off():
    async def go():
        outcome = asyncio.get_running_loop().create_future()
        ranks = {"p0": [Remote(FakePrefill("p0"))]}

        async def recover(name: str) -> bool:
            return await outcome
        monitor = HealthMonitor({"p0": "prefill"}, ranks.get, 60.0, 1.0, recover=recover)
        off = HealthMonitor({"p0": "prefill"}, ranks.get, 60.0, 1.0)
        assert not monitor.returning("p0")  # healthy: not out of service
        monitor.report_failure("p0", "gone")
        assert monitor.get("p0").state is Health.RECOVERING and monitor.returning("p0")
        outcome.set_result(False)
        for _ in range(100):  # the recovery task ends: a fresh probe is not needed
            if monitor.get("p0").state is not Health.RECOVERING:
                break
            await asyncio.sleep(0.01)
        # NOTE: a failed restart is tried again after a backoff: still coming back
        assert monitor.get("p0").state is Health.UNHEALTHY and monitor.returning("p0")
        assert monitor.get("p0").retry_at is not None
        await monitor.stop()
        assert not monitor.returning("p0")
        off.report_failure("p0", "gone")
        assert not off.returning("p0")
    asyncio.run(go())


def test_a_restart_due_after_the_deadline_is_unavailable_at_once():
    async def go():
        health = FakeHealth(["p0", "d0"])
        health.state["p0"] = "recovering"  # NOTE: its restart budget is used up for 60 s
        health.retry_at["p0"] = time.time() + 60
        avail, pools = Availability(health), _pools(health)
        woken = asyncio.get_running_loop().create_future()
        start = time.monotonic()
        with pytest.raises(RequestError, match="no restart of one is due before this "
                                               "request's deadline"):
            await avail.wait(pools, start + 30, woken)
        assert time.monotonic() - start < 0.5
        health.retry_at["p0"] = time.time() + 0.2  # due before the deadline: it waits
        waiter = asyncio.ensure_future(avail.wait(pools, time.monotonic() + 30, woken))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        health.set("p0", "healthy")
        await asyncio.wait_for(waiter, 1.0)
    asyncio.run(go())

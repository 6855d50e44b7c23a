"""HealthMonitor with fake rank handles: dead, hung, recovered, refused, flapping ranks."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorDiedError

from orchestrator.deploy.health import Health, HealthMonitor
from orchestrator.router.policies import LeastOutstandingTokens, RoundRobin


class FakeRank:
    """A rank actor handle look-alike whose ``node_info`` answers, raises (dead) or hangs."""

    def __init__(self) -> None:
        self.mode = "ok"  # "ok" | "dead" | "hung"
        self.pings = 0
        self._never = asyncio.Event()

    @property
    def node_info(self):
        rank = self

        class _Method:
            @staticmethod
            def remote():
                async def run():
                    rank.pings += 1
                    if rank.mode == "dead":
                        raise ActorDiedError()
                    if rank.mode == "hung":
                        await rank._never.wait()
                    return "node-a", "cpu"
                return run()

            @staticmethod
            def options(**_):
                return _Method
        return _Method


class Scenario:
    """Two instances (prefill-0, decode-0 with 2 ranks); records hook calls and changes."""

    def __init__(self, recover=None, probe_timeout_s: float = 5.0,
                 probe_interval_s: float = 0.02, on_unhealthy=None) -> None:
        self.ranks = {"prefill-0": [FakeRank()], "decode-0": [FakeRank(), FakeRank()]}
        self.failed: list[tuple[str, str]] = []
        self.changes: list[tuple[str, Health]] = []
        self.monitor = HealthMonitor({"prefill-0": "prefill", "decode-0": "decode"},
                                     lambda name: self.ranks[name],
                                     probe_interval_s=probe_interval_s,
                                     probe_timeout_s=probe_timeout_s,
                                     on_unhealthy=on_unhealthy or (
                                         lambda n, r: self.failed.append((n, r))),
                                     recover=recover, recover_timeout_s=5.0)
        self.monitor.add_listener(lambda h: self.changes.append((h.name, h.state)))

    async def until(self, predicate, timeout_s: float = 5.0) -> float:
        """Seconds until ``predicate()`` holds (fails the test after ``timeout_s``)."""
        start = time.monotonic()
        while not predicate():
            assert time.monotonic() - start < timeout_s, (self.changes, self.failed)
            await asyncio.sleep(0.005)
        return time.monotonic() - start


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_dead_rank_is_unhealthy_at_once_and_stays_so_without_recovery():
    async def scenario():
        s = Scenario(probe_timeout_s=10.0)
        s.monitor.start()
        await asyncio.sleep(0.1)
        assert s.monitor.is_healthy("decode-0") and s.changes == []
        s.ranks["decode-0"][1].mode = "dead"
        took = await s.until(lambda: not s.monitor.is_healthy("decode-0"))
        assert took < 1.0  # NOTE: far below probe_timeout_s: a dead actor answers at once
        assert s.failed == [("decode-0", "rank 1 is gone (ActorDiedError)")]
        health = s.monitor.get("decode-0")
        assert health.state is Health.UNHEALTHY
        assert "rank 1 is gone" in health.reason and "restart `orch up`" in health.reason
        s.ranks["decode-0"][1].mode = "ok"  # a zombie that answers again stays out
        await asyncio.sleep(0.2)
        assert not s.monitor.is_healthy("decode-0") and s.monitor.is_healthy("prefill-0")
        assert s.monitor.roles_without_healthy() == ["decode"]
        assert s.changes == [("decode-0", Health.UNHEALTHY)]
        await s.monitor.stop()
    run(scenario())


def test_probe_soon_does_not_wait_for_the_next_turn():
    async def scenario():
        s = Scenario(probe_interval_s=30.0)
        s.monitor.start()
        await s.until(lambda: s.ranks["decode-0"][1].pings == 1)
        s.ranks["decode-0"][1].mode = "dead"
        s.monitor.probe_soon("decode-0")  # e.g. its status call just failed
        assert await s.until(lambda: not s.monitor.is_healthy("decode-0")) < 1.0
        await asyncio.wait_for(s.monitor.stop(), 1.0)
    run(scenario())


def test_hung_rank_is_unhealthy_after_the_probe_timeout():
    async def scenario():
        s = Scenario(probe_timeout_s=0.3)
        s.monitor.start()
        s.ranks["decode-0"][0].mode = "hung"
        took = await s.until(lambda: not s.monitor.is_healthy("decode-0"))
        assert 0.3 <= took < 0.3 + 0.02 + 0.5, took
        assert "rank 0 did not answer a ping within health.probe_timeout_s=0.3 s" in \
            s.failed[0][1]
        pings = s.ranks["decode-0"][0].pings
        await asyncio.sleep(0.2)
        assert s.ranks["decode-0"][0].pings == pings  # NOTE: no calls pile up on a hung rank
        await s.monitor.stop()
    run(scenario())


def test_recovered_instance_is_healthy_again_with_its_new_ranks():
    calls = []

    async def scenario():
        async def recover(name: str) -> bool:
            calls.append(name)
            assert s.monitor.get(name).state is Health.RECOVERING
            await asyncio.sleep(0.05)
            s.ranks[name] = [FakeRank(), FakeRank()]  # the restart made new actors
            return True

        s = Scenario(recover=recover)
        s.monitor.start()
        s.ranks["decode-0"][0].mode = "dead"
        await s.until(lambda: calls)
        s.monitor.report_failure("decode-0", "seen twice")  # ignored while recovering
        await s.until(lambda: s.monitor.is_healthy("decode-0"))
        assert calls == ["decode-0"] and len(s.failed) == 1
        assert s.changes == [("decode-0", Health.UNHEALTHY), ("decode-0", Health.RECOVERING),
                             ("decode-0", Health.HEALTHY)]
        assert s.monitor.get("decode-0").reason == ""
        assert all(r.pings >= 1 for r in s.ranks["decode-0"])  # probed after the restart
        await s.monitor.stop()
    run(scenario())


@pytest.mark.parametrize("outcome", ["refused", "raises", "still dead"])
def test_failed_recovery_leaves_it_unhealthy_with_the_reason(outcome):
    calls = []

    async def scenario():
        async def recover(name: str) -> bool:
            calls.append(name)
            if outcome == "raises":
                raise RuntimeError("no node has room")
            return outcome == "still dead"  # "restarted", yet the probe after it fails

        s = Scenario(recover=recover)
        s.monitor.start()
        s.ranks["prefill-0"][0].mode = "dead"
        await s.until(lambda: s.changes[-1:] == [("prefill-0", Health.UNHEALTHY)]
                      and len(s.changes) == 3)
        await asyncio.sleep(0.1)
        assert calls == ["prefill-0"]  # once per turn to unhealthy, not per probe
        reason = s.monitor.get("prefill-0").reason
        assert reason.startswith("rank 0 is gone (ActorDiedError); ")
        assert {"refused": "failed or was refused", "raises": "raised RuntimeError: no node",
                "still dead": "rank 0 is gone"}[outcome] in reason.split("; ", 1)[1]
        assert s.monitor.roles_without_healthy() == ["prefill"]
        await s.monitor.stop()
    run(scenario())


def test_flapping_rank_gets_one_hook_call_and_one_restart_per_failure():
    calls, running = [], []

    async def scenario():
        async def recover(name: str) -> bool:
            assert not running, "two restarts of one instance at once"
            running.append(name)
            calls.append(name)
            await asyncio.sleep(0.03)
            rank.mode = "ok"
            running.clear()
            return True

        s = Scenario(recover=recover)
        rank = s.ranks["decode-0"][1]
        s.monitor.start()
        for _ in range(4):  # the rank dies again after every restart
            await s.until(lambda: s.monitor.is_healthy("decode-0"))
            await asyncio.sleep(0.05)
            rank.mode = "dead"
            await s.until(lambda: not s.monitor.is_healthy("decode-0"))
        await s.until(lambda: s.monitor.is_healthy("decode-0"))
        assert len(calls) == len(s.failed) == 4
        assert s.changes == [("decode-0", state) for state in
                             (Health.UNHEALTHY, Health.RECOVERING, Health.HEALTHY) * 4]
        await s.monitor.stop()
    run(scenario())


def test_stop_ends_every_task_even_with_a_hung_rank_and_a_running_recovery():
    async def scenario():
        async def recover(name: str) -> bool:
            await asyncio.Event().wait()  # never returns
            return True

        s = Scenario(recover=recover, probe_timeout_s=10.0)
        s.ranks["decode-0"][1].mode = "hung"
        s.ranks["prefill-0"][0].mode = "dead"
        s.monitor.start()
        await s.until(lambda: s.monitor.get("prefill-0").state is Health.RECOVERING)
        await asyncio.wait_for(s.monitor.stop(), 2.0)
        await asyncio.sleep(0)
        ours = ("_watch", "_recover_one", "_ping")
        left = [t for t in asyncio.all_tasks() if t.get_coro().__name__ in ours]
        assert left == []
    run(scenario())


def test_a_failing_hook_or_listener_does_not_stop_the_monitor():
    async def scenario():
        s = Scenario(on_unhealthy=lambda n, r: 1 / 0)
        s.monitor.add_listener(lambda h: [][1])
        s.monitor.start()
        s.ranks["prefill-0"][0].mode = "dead"
        s.ranks["decode-0"][0].mode = "dead"
        await s.until(lambda: s.monitor.roles_without_healthy() == ["decode", "prefill"])
        await s.monitor.stop()
    run(scenario())


@pytest.mark.parametrize("cls", [RoundRobin, LeastOutstandingTokens])
def test_policies_order_only_healthy_instances(cls):
    sick = set()
    p = cls(["d0", "d1", "d2"], healthy=lambda name: name not in sick)
    assert sorted(p.order()) == ["d0", "d1", "d2"]
    sick.add("d0")
    for _ in range(3):
        assert sorted(p.order()) == ["d1", "d2"]
    p.acquire("d1", 10)  # load accounting goes on as before
    assert p.outstanding == {"d0": 0, "d1": 10, "d2": 0}
    sick.update({"d1", "d2"})
    assert p.order() == []
    sick.clear()
    assert "d0" in p.order()


def test_a_failed_restart_is_retried_with_growing_delay_until_the_instance_is_back():
    """No cliff: restarts that fail (or that the budget defers) are tried again, each after a
    longer delay, and the instance comes back by itself once a restart works; meanwhile its
    reason names why and when the next try is, and retry_after_s follows that try."""
    tries: list[float] = []

    async def scenario():
        async def recover(name: str) -> bool:
            tries.append(time.monotonic())
            if len(tries) < 4:
                return False
            s.ranks["decode-0"][1].mode = "ok"
            return True

        deferred = {"left": 1}

        def restart_wait(name: str):
            if len(tries) == 2 and deferred["left"]:  # the budget defers the third try once
                deferred["left"] -= 1
                return 0.05, "restart budget used up"
            return None

        s = Scenario(recover=recover)
        s.monitor = HealthMonitor({"prefill-0": "prefill", "decode-0": "decode"},
                                  lambda name: s.ranks[name], probe_interval_s=0.02,
                                  probe_timeout_s=5.0, recover=recover, recover_timeout_s=5.0,
                                  backoff_s=0.05, backoff_max_s=0.15, restart_wait=restart_wait)
        s.monitor.start()
        s.ranks["decode-0"][1].mode = "dead"
        await s.until(lambda: len(tries) == 1)
        await s.until(lambda: s.monitor.get("decode-0").retry_at is not None)
        waiting = s.monitor.get("decode-0")
        assert waiting.state is Health.UNHEALTHY
        assert "failed or was refused" in waiting.reason
        assert "next restart try in 0 s (at " in waiting.reason
        assert 0 < s.monitor.retry_after_s() <= 1.0
        await s.until(lambda: s.monitor.is_healthy("decode-0"), timeout_s=10)
        assert s.monitor.get("decode-0").retry_at is None
        assert s.monitor.capacity() == {"prefill": (1, 1), "decode": (1, 1)}
        await s.monitor.stop()
    run(scenario())
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert len(tries) == 4
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.15, gaps  # 0.05, 0.1+, 0.15 cap

"""Recoverer against a fake cluster (no Ray): rebinding, bounded restart rate, one restart at
a time per instance, failures and timeouts that return False and never raise."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

from orchestrator.deploy.rank_actors import BringUpError
from orchestrator.router.leader import LeaderClient
from orchestrator.deploy.recovery import Recoverer


class FakeCluster:
    """``restart_instance`` returns new leader handles ``"<name>#<n>"`` for the instance's
    group (``groups``, default: itself alone); ``fail`` makes it raise; ``gate`` (an Event)
    makes it block until set."""

    def __init__(self, groups: dict[str, list[str]] | None = None) -> None:
        self.calls: list[str] = []
        self.fail = False
        self.gate: threading.Event | None = None
        self.groups = groups or {}

    def restart_group(self, name: str) -> list[str]:
        return self.groups.get(name, [name])

    def restart_instance(self, name: str, timeout_s: float) -> list[SimpleNamespace]:
        self.calls.append(name)
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail:
            raise BringUpError(f"{name} rank 0: init_rank failed: simulated")
        return [SimpleNamespace(cfg=SimpleNamespace(name=n), leader=f"{n}#{len(self.calls)}")
                for n in self.restart_group(name)]


def _leaders() -> dict[str, LeaderClient]:
    return {n: LeaderClient(n, "decode", f"{n}#0", call_timeout_s=1.0)
            for n in ("decode-0", "decode-1")}


def test_recover_rebinds_the_client_to_the_new_leader():
    cluster, leaders = FakeCluster(), _leaders()
    rec = Recoverer(cluster, leaders, timeout_s=5.0)
    assert asyncio.run(rec.recover("decode-0")) is True
    assert leaders["decode-0"].handle == "decode-0#1"
    assert leaders["decode-1"].handle == "decode-1#0"
    assert rec.restarts("decode-0") == 1


def test_an_expert_parallel_group_restarts_once_for_all_its_instances():
    """Both decode instances of an EP role fail; their two recoveries run ONE restart of the
    group, and both clients are rebound."""
    group = ["decode-0", "decode-1"]
    cluster, leaders = FakeCluster({name: group for name in group}), _leaders()
    cluster.gate = threading.Event()
    rec = Recoverer(cluster, leaders, timeout_s=5.0)

    async def run() -> list[bool]:
        first = asyncio.ensure_future(rec.recover("decode-0"))
        while not cluster.calls:
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(rec.recover("decode-1"))
        await asyncio.sleep(0.05)
        cluster.gate.set()
        return list(await asyncio.gather(first, second))
    assert asyncio.run(run()) == [True, True]
    assert cluster.calls == ["decode-0"]
    assert [leaders[n].handle for n in group] == ["decode-0#1", "decode-1#1"]
    assert rec.restarts("decode-1") == 1


def test_restart_rate_is_bounded_per_instance_with_one_line_saying_why(caplog):
    cluster, leaders = FakeCluster(), _leaders()
    rec = Recoverer(cluster, leaders, max_restarts=2, window_s=60.0, timeout_s=5.0)

    async def run() -> list[bool]:
        return [await rec.recover("decode-0") for _ in range(3)] + [
            await rec.recover("decode-1")]
    with caplog.at_level(logging.WARNING, logger="orchestrator.deploy.recovery"):
        assert asyncio.run(run()) == [True, True, False, True]
    assert cluster.calls == ["decode-0", "decode-0", "decode-1"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "decode-0: not restarted" in line and "max_restarts=2" in line
    assert "`orch up`" in line
    assert leaders["decode-0"].handle == "decode-0#2"


def test_the_window_slides():
    cluster, leaders = FakeCluster(), _leaders()
    rec = Recoverer(cluster, leaders, max_restarts=1, window_s=0.2, timeout_s=5.0)

    async def run() -> list[bool]:
        first, refused = await rec.recover("decode-0"), await rec.recover("decode-0")
        await asyncio.sleep(0.3)  # NOTE: the window itself is what is under test
        return [first, refused, await rec.recover("decode-0")]
    assert asyncio.run(run()) == [True, False, True]


def test_concurrent_calls_share_one_restart():
    cluster, leaders = FakeCluster(), _leaders()
    cluster.gate = threading.Event()
    rec = Recoverer(cluster, leaders, timeout_s=5.0)

    async def run() -> list[bool]:
        calls = [asyncio.create_task(rec.recover("decode-0")) for _ in range(3)]
        await asyncio.sleep(0)
        cluster.gate.set()
        return list(await asyncio.gather(*calls))
    assert asyncio.run(run()) == [True, True, True]
    assert cluster.calls == ["decode-0"]


def test_failed_restart_returns_false_keeps_the_old_handle_and_counts(caplog):
    cluster, leaders = FakeCluster(), _leaders()
    cluster.fail = True
    rec = Recoverer(cluster, leaders, max_restarts=1, timeout_s=5.0)
    with caplog.at_level(logging.WARNING, logger="orchestrator.deploy.recovery"):
        assert asyncio.run(rec.recover("decode-0")) is False
        assert asyncio.run(rec.recover("decode-0")) is False  # the failed one counted
    assert leaders["decode-0"].handle == "decode-0#0"
    assert cluster.calls == ["decode-0"]
    assert "init_rank failed: simulated" in caplog.records[0].getMessage()


def test_a_restart_past_its_bound_returns_false_and_is_not_overlapped():
    cluster, leaders = FakeCluster(), _leaders()
    cluster.gate = threading.Event()
    rec = Recoverer(cluster, leaders, timeout_s=0.1)

    async def run() -> list[bool]:
        late = await rec.recover("decode-0")       # the thread goes on past the bound
        again = await rec.recover("decode-0")      # answered by that same restart
        cluster.gate.set()
        while rec._running:  # noqa: SLF001 - wait for the thread to end
            await asyncio.sleep(0.01)
        return [late, again, await rec.recover("decode-0")]
    assert asyncio.run(run()) == [False, False, True]
    assert cluster.calls == ["decode-0", "decode-0"]


def test_unknown_instance_and_a_raising_cluster_never_raise():
    class Broken:
        def restart_instance(self, name, timeout_s):
            raise KeyError(name)
    rec = Recoverer(Broken(), _leaders(), timeout_s=1.0)
    assert asyncio.run(rec.recover("prefill-9")) is False
    assert asyncio.run(rec.recover("decode-0")) is False


def test_a_used_up_budget_says_when_the_next_restart_may_run():
    """The budget is a wait, not a verdict: restart_wait names the rule and the seconds until
    the oldest restart leaves the window, then lets a restart run again."""
    cluster, leaders = FakeCluster(), _leaders()
    rec = Recoverer(cluster, leaders, max_restarts=2, window_s=0.4, timeout_s=5.0)

    async def run():
        assert rec.restart_wait("decode-0") is None
        await rec.recover("decode-0")
        await rec.recover("decode-0")
        wait = rec.restart_wait("decode-0")
        await asyncio.sleep(wait[0] + 0.05)
        return wait, rec.restart_wait("decode-0"), await rec.recover("decode-0")
    (seconds, why), later, ok = asyncio.run(run())
    assert 0.2 < seconds <= 0.4
    assert "health.max_restarts=2" in why and "health.restart_window_s" in why
    assert later is None and ok is True
    assert cluster.calls == ["decode-0"] * 3

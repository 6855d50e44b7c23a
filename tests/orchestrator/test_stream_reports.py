"""The instances' own reports on their token streams: heartbeats, rank liveness, status rows.

The health monitor skips its Ray pings of an instance heard alive within its probe interval and
pings one that falls silent (hung: unhealthy within interval + timeout, as with pings alone);
the status board's refresh shows reported statuses without a Ray call; a status row survives
the wire; an idle leader's stream beats.
"""

from __future__ import annotations

import asyncio
import time

import msgpack

from orchestrator.deploy.health import HealthMonitor
from orchestrator.router.event_stream import EventSubscription
from orchestrator.router.reports import InstanceReports
from orchestrator.status import StatusBoard
from rank.event_stream import EventStream
from rank.messages import InstanceStatusInfo, KVTailStats, TransferRecord
from rank.status_row import status_from_row, status_row
from rank.step_timing import PhaseTiming, StepTimings
from tests.orchestrator.test_health import FakeRank

INTERVAL_S = 0.2


def _status(name: str = "decode-0", transfers=()) -> InstanceStatusInfo:
    return InstanceStatusInfo(
        name=name, role="decode", tp=2, ranks=((0, "n", "cpu", 11), (1, "n", "cpu", 12)),
        queue_depth=3, free_blocks=7, total_blocks=9, transfers=transfers, broken=None,
        step_timings=StepTimings(PhaseTiming(4, 0.5, (0.1, 0.2)),
                                 {"forward": PhaseTiming(4, 0.25, (0.05,))}),
        kv_tail=KVTailStats(2, 0.3, 0.2, 0.1), spec_acceptance_rate=0.5)


def test_a_status_row_survives_the_wire():
    status = _status(transfers=(TransferRecord("prefill-0:0->decode-0:0", 1024, 0.01, True),))
    wire = msgpack.unpackb(msgpack.packb(status_row(status), use_bin_type=True), raw=False)
    assert status_from_row(wire) == status


def _started() -> tuple[InstanceReports, FakeRank, HealthMonitor]:
    """A started monitor of decode-0 (one fake rank) that has just heard from it."""
    reports, rank = InstanceReports(beat_s=INTERVAL_S / 2), FakeRank()
    monitor = HealthMonitor({"decode-0": "decode"}, lambda name: [rank], INTERVAL_S, 0.3,
                            reports=reports)
    reports.heard("decode-0", 0.0, None)
    monitor.start()
    return reports, rank, monitor


def test_an_instance_heard_alive_is_not_pinged_and_a_silent_one_is():
    async def scenario():
        reports, rank, monitor = _started()
        for _ in range(10):  # NOTE: heard every half interval for 1 s: never pinged
            await asyncio.sleep(INTERVAL_S / 2)
            reports.heard("decode-0", 0.0, None)
        assert rank.pings == 0 and monitor.is_healthy("decode-0")
        monitor.probe_soon("decode-0")  # NOTE: asked: pinged even though heard
        await asyncio.sleep(0.05)
        assert rank.pings == 1
        rank.mode = "hung"  # silent from now on, and its ping never answers
        silent = time.monotonic()
        while monitor.is_healthy("decode-0"):
            await asyncio.sleep(0.01)
        took = time.monotonic() - silent
        # NOTE: as with pings alone: at most one interval to the ping, then its timeout
        assert 0.3 <= took < INTERVAL_S + 0.3 + 0.2, took
        await monitor.stop()
    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_lost_stream_is_pinged_at_once():
    async def scenario():
        reports, rank, monitor = _started()
        await asyncio.sleep(0.05)
        assert rank.pings == 0
        rank.mode = "dead"
        reports.lost("decode-0")
        await asyncio.sleep(0.05)
        assert not monitor.is_healthy("decode-0") and rank.pings == 1
        await monitor.stop()
    asyncio.run(asyncio.wait_for(scenario(), 10))


class _Leader:
    """A LeaderClient look-alike counting its status calls."""

    name, role = "decode-0", "decode"

    def __init__(self) -> None:
        self.calls = 0

    async def status(self, timeout_s: float) -> InstanceStatusInfo:
        self.calls += 1
        return _status()


class _Metrics:
    def __init__(self) -> None:
        self.transfers = 0

    def update_instances(self, statuses) -> None:
        self.transfers += sum(len(s.transfers) for s in statuses)


def test_the_board_refresh_shows_reports_and_counts_each_transfer_once():
    async def scenario():
        reports, leader, metrics = InstanceReports(), _Leader(), _Metrics()
        monitor = HealthMonitor({"decode-0": "decode"}, lambda name: [], 1.0, 1.0)
        board = StatusBoard(lambda: [leader], {"decode": 2}, monitor, metrics, 1.0, reports)
        record = TransferRecord("prefill-0:0->decode-0:0", 8, 0.1, True)
        reports.heard("decode-0", None, _status(transfers=(record,)))
        views = await board.views(reported=True)
        assert leader.calls == 0 and views[0].status.queue_depth == 3
        await board.views(reported=True)
        assert leader.calls == 0 and metrics.transfers == 1
        await board.views()  # NOTE: GetStatus asks the leader afresh
        assert leader.calls == 1
    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_an_idle_stream_beats_and_carries_the_status():
    async def scenario():
        stream = EventStream("decode-0", "127.0.0.1")

        async def open_events(subscriber: str):
            return stream.open(subscriber, beat_s=0.05)
        sub = EventSubscription("decode-0", "decode", "router-a", open_events)
        frames = sub.frames()
        first = asyncio.ensure_future(frames.__anext__())
        await asyncio.sleep(0.05)
        assert stream.flush(5, 0.0)  # NOTE: the first frame (capacity to report)
        assert (await first).ranks_age_s == 0.0
        assert not stream.flush(5, 0.0)  # nothing new, no beat due yet
        await asyncio.sleep(0.06)
        assert stream.flush(5, 0.0)  # the heartbeat
        beat = await frames.__anext__()
        assert beat.events == () and beat.status is None
        stream.set_status(status_row(_status()))
        assert stream.flush(5, 1.5)
        report = await frames.__anext__()
        assert report.status == _status() and report.ranks_age_s == 1.5
        await frames.aclose()
        stream.close()
    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_the_leader_reports_its_status_and_that_its_ranks_live_only_when_all_answered():
    import threading
    import types

    from rank.status_report import StatusReporter

    stream = EventStream("decode-0", "127.0.0.1")
    alive: list[float] = []
    leader = types.SimpleNamespace(stream=stream, wake=threading.Event(),
                                   ranks_alive=alive.append)
    answers = [TimeoutError("rank 1 did not answer"), _status()]

    def status() -> InstanceStatusInfo:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    reporter = StatusReporter("decode-0", leader, status)
    try:
        reporter.report_once()  # NOTE: a hung follower: no report, no proof of life
        assert alive == [] and stream._status is None
        reporter.report_once()
        assert len(alive) == 1 and status_from_row(stream._status) == _status()
        assert leader.wake.is_set()
    finally:
        stream.close()


def test_a_status_replaced_before_it_was_sent_keeps_its_transfer_records():
    from rank.status_row import merge_rows

    first, second = (TransferRecord(f"prefill-0:0->decode-0:{r}", 8, 0.1, True) for r in (0, 1))
    stream = EventStream("decode-0", "127.0.0.1")
    stream.set_status(status_row(_status(transfers=(first,))))  # NOTE: no flush in between
    stream.set_status(status_row(_status(transfers=(second,))))
    assert status_from_row(stream._status).transfers == (first, second)
    assert merge_rows(status_row(_status()), status_row(_status(transfers=(second,)))) == \
        status_row(_status(transfers=(second,)))
    stream.close()

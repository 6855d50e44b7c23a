"""Fencing: an instance the health monitor declared failed is out of the requests' way until
it is restarted (orchestrator/router/leader.py). A hung prefill that wakes up (SIGCONT) must not
hand a late first token to a request, and a router whose health view lags (a replica's mirror,
the monitor's next state change) must not start new work there."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.api.client import OrchClient
from orchestrator.router.event_stream import EventFrame
from orchestrator.router.event_pump import EventPump
from orchestrator.router.leader import LeaderClient, LeaderError
from rank.messages import Abort, Prefill, TokenEvent
from tests.orchestrator.fakes import FakePrefill, Remote, expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_router import _calls
from tests.orchestrator.test_router_failover import PROMPT, _all_released


def _frame(seq: int, *events: TokenEvent) -> EventFrame:
    return EventFrame(seq, 10, tuple(events))


def test_a_fenced_leaders_events_are_dropped_until_it_is_rebound():
    async def go():
        leader = LeaderClient("prefill-0", "prefill", Remote(FakePrefill()), 5.0)
        pump = EventPump([leader])
        inbox = pump.register("r@1", "r", {"prefill-0"})
        leader.fence("rank 0 did not answer a ping")
        pump._dispatch(leader, _frame(0, TokenEvent("r@1", (7,), None, None, "prefill",
                                                    "prefill-0")))
        assert inbox.take() is None  # NOTE: the late first token of a failed instance
        leader.rebind(Remote(FakePrefill()))  # restarted: in service again
        assert leader.fenced is None
        pump._dispatch(leader, _frame(1, TokenEvent("r@1", (8,), None, None, "prefill",
                                                    "prefill-0")))
        assert inbox.take().token_ids == (8,)
    asyncio.run(go())


def test_a_fenced_leader_refuses_new_work_but_takes_aborts():
    async def go():
        fake = FakePrefill()
        leader = LeaderClient("prefill-0", "prefill", Remote(fake), 5.0)
        leader.fence("rank 0 is gone")
        spec = None  # NOTE: never sent: the refusal comes before the call
        with pytest.raises(LeaderError, match=r"prefill-0.prefill refused: the instance was "
                                              r"declared failed \(rank 0 is gone\)"):
            await leader.call(Prefill(spec, None))
        await leader.call(Abort("r@1"))  # NOTE: frees what a woken instance still holds
        assert fake.calls == [("abort", "r@1")]
    asyncio.run(go())


def test_an_attempt_that_comes_to_depend_on_a_fenced_instance_fails_at_once():
    async def go():
        leader = LeaderClient("decode-0", "decode", Remote(FakePrefill()), 5.0)
        pump = EventPump([leader])
        inbox = pump.register("r@1", "r", set())
        leader.fence("SIGSTOPped")
        pump.widen("r@1", {"decode-0"})
        with pytest.raises(Exception, match="decode-0 failed: SIGSTOPped"):
            inbox.take()
    asyncio.run(go())


def test_a_failed_instance_the_health_view_still_calls_healthy_gets_no_new_work():
    """The router was told prefill-0 failed, but its health view still says healthy (round
    robin picks it): the request is placed again on prefill-1 and prefill-0 sees no call."""
    h = Harness(prefill_dp=2)
    try:
        h.call_in_loop(lambda: h.router.fleet.instance_failed("prefill-0", "no heartbeat for 5 s"))
        for n in range(2):  # NOTE: round robin starts one of them on prefill-0
            with OrchClient(h.address) as client:
                chunks = list(client.generate(token_ids=list(PROMPT), request_id=f"f{n}",
                                              max_tokens=3))
            assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 3)
            assert chunks[-1].stats.prefill_instance == "prefill-1"
        assert [c for c in _calls(h, "prefill-0") if c[0] != "abort"] == []
        assert _all_released(h)
    finally:
        h.close()

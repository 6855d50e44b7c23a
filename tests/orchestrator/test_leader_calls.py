"""Leader calls over the call socket (``router.leader_calls: socket``): the router sees the
same answers and the same error text as over Ray, a broken connection fails the calls in
flight and the next call connects again, every call stays bounded (its timeout, abandon),
a rebind moves the calls to the new leader, and the server leaves no thread behind."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rank.messages import Abort
from orchestrator.router.leader import LeaderClient, LeaderError
from tests.orchestrator.call_fakes import (WAIT_S, Leader, RayHandle, answer, leader, run,
                                           threads_named, until)
from tests.orchestrator.fakes import Remote

__all__ = ["leader"]  # NOTE: the fixture, used by name


async def _outcome(client: LeaderClient, request):
    try:
        return "answer", await client.call(request)
    except LeaderError as exc:
        return "error", str(exc)


def test_answers_and_errors_equal_the_ray_path(leader):
    requests = [Abort("r1"), Abort("x1"), Abort("rejected"), Abort("out"),
                Abort("unpicklable"), "not a request"]

    async def go():
        ray = LeaderClient("decode-0", "decode", RayHandle(leader), 5.0)
        sock = LeaderClient("decode-0", "decode", RayHandle(leader), 5.0, calls="socket")
        try:
            return ([await _outcome(ray, r) for r in requests],
                    [await _outcome(sock, r) for r in requests])
        finally:
            await sock.close()

    over_ray, over_socket = run(go())
    # NOTE: an exception that does not pickle: Ray says only that ("RayError: Exception ...
    # isn't serializable"), the socket keeps its own first line
    assert over_ray[4][1].startswith("decode-0.abort failed: RayError: Exception ")
    assert over_socket[:4] + over_socket[5:] == over_ray[:4] + over_ray[5:]
    assert over_socket[:3] == [("answer", True), ("answer", False), ("answer", answer(
        Abort("rejected")))]
    assert over_socket[3:] == [
        ("error", "decode-0.abort failed: InstanceOutOfService: decode-0 is out of service: "
                  "rank 1 is dead"),
        ("error", "decode-0.abort failed: Unpicklable: a lock inside"),
        ("error", "decode-0.str failed: TypeError: decode-0 does not take str")]
    assert leader.opens == 1  # NOTE: one connection for every call


def test_a_broken_connection_fails_the_call_in_flight_and_the_next_connects_again():
    entered, release = threading.Event(), threading.Event()

    def hang_first(request):
        if request.request_id == "hang":
            entered.set()
            release.wait(WAIT_S)
        return True

    leader = Leader(hang_first)

    async def go():
        client = LeaderClient("decode-0", "decode", Remote(leader), 10.0, calls="socket")
        try:
            call = asyncio.ensure_future(client.call(Abort("hang")))
            assert await asyncio.to_thread(entered.wait, WAIT_S)
            started = time.monotonic()
            leader.server.break_connections()
            with pytest.raises(LeaderError) as err:
                await call
            assert time.monotonic() - started < 2.0
            assert await client.call(Abort("next")) is True
            return str(err.value)
        finally:
            release.set()
            await client.close()

    try:
        error = run(go())
    finally:
        leader.server.close()
    assert error.startswith("decode-0.abort failed: CallConnectionLost: decode-0: the "
                            "connection to its leader's call server ended"), error
    assert leader.opens == 2


def test_a_hung_leader_is_bounded_by_the_timeout_and_by_abandon():
    release = threading.Event()

    def hang(request):
        if request.request_id.startswith("hang"):
            release.wait(WAIT_S)
        return request.request_id

    leader = Leader(hang)

    async def go():
        client = LeaderClient("decode-0", "decode", Remote(leader), 30.0, calls="socket")
        try:
            started = time.monotonic()
            with pytest.raises(LeaderError, match=r"decode-0.abort did not answer within 0.3 s"):
                await client.call(Abort("hang-1"), timeout_s=0.3)
            timed_out = time.monotonic() - started
            call = asyncio.ensure_future(client.call(Abort("hang-2")))
            await asyncio.sleep(0.1)
            started = time.monotonic()
            client.abandon_calls("decode-0 failed: SIGSTOPped")
            with pytest.raises(LeaderError, match="decode-0.abort was abandoned: decode-0 "
                                                  "failed: SIGSTOPped"):
                await call
            abandoned = time.monotonic() - started
            # NOTE: the same connection still answers; the late answers are dropped
            assert await client.call(Abort("fine")) == "fine"
            release.set()
            assert await client.call(Abort("after")) == "after"
            return timed_out, abandoned
        finally:
            release.set()
            await client.close()

    try:
        timed_out, abandoned = run(go())
    finally:
        leader.server.close()
    assert 0.3 <= timed_out < 2.0 and abandoned < 1.0
    assert leader.opens == 1


def test_rebind_sends_later_calls_to_the_new_leader():
    old, new = Leader(lambda r: "old"), Leader(lambda r: "new")

    async def go():
        client = LeaderClient("decode-0", "decode", Remote(old), 5.0, calls="socket")
        try:
            first = await client.call(Abort("a"))
            client.rebind(Remote(new))
            return first, await client.call(Abort("b"))
        finally:
            await client.close()

    try:
        assert run(go()) == ("old", "new")
        assert (old.opens, new.opens) == (1, 1)
        # NOTE: the old connection was closed by the rebind
        assert until(lambda: not threads_named("decode-0-calls-in"))
    finally:
        old.server.close()
        new.server.close()


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_served_request_over_the_socket_equals_its_script(mode):
    from orchestrator.api.client import OrchClient
    from tests.orchestrator.fakes import expected_tokens
    from tests.orchestrator.harness import Harness

    h = Harness(mode=mode, eager_prefill=True, leader_calls="socket")
    try:
        with OrchClient(h.address) as client:
            for rid in ("s1", "s2"):
                chunks = list(client.generate(token_ids=[5, 6, 7], max_tokens=5,
                                              request_id=rid))
                assert [t for c in chunks for t in c.token_ids] == expected_tokens((5, 6, 7), 5)
        # NOTE: every leader call went over its fake's call server, one connection each
        assert all(f.call_server is not None and f.calls for f in h.fakes.values())
    finally:
        h.close()


def test_the_prefill_call_is_written_before_the_reserve():
    """Eager PD over the socket keeps the order the Ray path has (the prompt's compute
    starts first; tests/orchestrator/test_eager_prefill_router.py for Ray)."""
    from orchestrator.api.client import OrchClient
    from tests.orchestrator.harness import Harness

    h = Harness(eager_prefill=True, leader_calls="socket")
    sent: list = []
    try:
        with OrchClient(h.address) as client:
            list(client.generate(token_ids=[5, 6, 7], max_tokens=3, request_id="warm"))

            def wrap():
                for name in ("prefill-0", "decode-0"):
                    channel = h.router.flow.leader(name)._channel
                    conn = channel._conn  # NOTE: connected by the warm-up: calls write at once
                    send = conn.call

                    async def call(request, send=send, name=name):
                        sent.append((name, type(request).__name__))
                        return await send(request)
                    conn.call = call
            h.call_in_loop(wrap)
            list(client.generate(token_ids=[5, 6, 7], max_tokens=3, request_id="o1"))
        assert sent[:2] == [("prefill-0", "Prefill"), ("decode-0", "Reserve")]
    finally:
        h.close()


def test_a_rebind_while_connecting_fails_the_waiting_call_not_cancels_it():
    """The old channel closes under a call that waits for its connection: the call fails
    with LeaderError (an instance failure to the flow), never with CancelledError."""
    leader = Leader(lambda r: "new")

    class Slow:
        def __init__(self) -> None:
            self.asked = asyncio.Event()

        async def open_calls(self):
            self.asked.set()
            await asyncio.sleep(WAIT_S)

    async def go():
        slow = Slow()
        client = LeaderClient("decode-0", "decode", Remote(slow), 10.0, calls="socket")
        try:
            call = asyncio.ensure_future(client.call(Abort("a")))
            await asyncio.wait_for(slow.asked.wait(), WAIT_S)
            client.rebind(Remote(leader))
            with pytest.raises(LeaderError, match="closed while connecting"):
                await asyncio.wait_for(call, WAIT_S)
            return await client.call(Abort("b"))
        finally:
            await client.close()

    try:
        assert run(go()) == "new"
    finally:
        leader.server.close()


def test_a_dead_leader_reads_as_over_ray():
    """The call connection's Ray call (``open_calls``) to a dead actor fails with Ray's own
    error, so the router's line is the one a Ray leader call gives."""
    from ray.exceptions import ActorDiedError

    class Dead:
        def open_calls(self):
            raise ActorDiedError()

        def request(self, request):
            raise ActorDiedError()

    async def go():
        lines = []
        for calls in ("ray", "socket"):
            client = LeaderClient("decode-0", "decode", Remote(Dead()), 5.0, calls=calls)
            try:
                await client.call(Abort("a"))
            except LeaderError as exc:
                lines.append(str(exc))
            finally:
                await client.close()
        return lines

    over_ray, over_socket = run(go())
    assert over_socket == over_ray
    assert "a rank process of this instance is gone" in over_socket

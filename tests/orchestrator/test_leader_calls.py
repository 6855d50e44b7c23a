"""Leader calls over the call socket (``router.leader_calls: socket``): the router sees the
same answers and the same error text as over Ray, a broken connection fails the calls in
flight and the next call connects again, every call stays bounded (its timeout, abandon),
a rebind moves the calls to the new leader, and the server leaves no thread behind."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
import time

import pytest
from ray.exceptions import RayTaskError

from rank.call_server import LEN, CallServer, frame
from rank.messages import Abort, InstanceOutOfService, Rejection
from orchestrator.router.leader import LeaderClient, LeaderError
from tests.orchestrator.descriptors import connect_during_shortage
from tests.orchestrator.drip import seconds_until_closed
from tests.orchestrator.fakes import Remote

WAIT_S = 5.0  # every wait of these tests


class Leader:
    """A leader end: ``request`` runs ``handle`` (the Ray path), ``open_calls`` opens a real
    :class:`CallServer` around the same ``handle``."""

    def __init__(self, handle, name: str = "decode-0") -> None:
        self.handle, self.name = handle, name
        self.server = CallServer(name, "127.0.0.1", handle, threads=4)
        self.opens = 0

    def open_calls(self):
        self.opens += 1
        return self.server.open()

    def request(self, request):
        return self.handle(request)


class RayHandle(Remote):
    """Remote(leader) whose ``request`` fails as a Ray actor call does: the worker's exception
    inside a ``RayTaskError`` that is also an instance of it (``as_instanceof_cause``)."""

    def __getattr__(self, name):
        method = super().__getattr__(name)
        if name != "request":
            return method

        class _Method:
            @staticmethod
            def remote(*args):
                async def run():
                    try:
                        return await method.remote(*args)
                    except Exception as exc:
                        raise RayTaskError("request", "traceback", exc).as_instanceof_cause()
                return run()
        return _Method


class Unpicklable(RuntimeError):
    """An error whose pickle fails (it holds a lock): only its line can travel."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.lock = threading.Lock()


def answer(request):
    """A handler: an Abort answers whether the id starts with "r"; other requests raise what
    their id names."""
    if isinstance(request, Abort):
        rid = request.request_id
        if rid == "out":
            raise InstanceOutOfService("decode-0 is out of service: rank 1 is dead\n(detail)")
        if rid == "unpicklable":
            raise Unpicklable("a lock inside\nsecond line")
        if rid == "rejected":
            return Rejection(rid, "decode-0 is full (0 of 8 blocks free, 2 needed)",
                             blocks_needed=2)
        return rid.startswith("r")
    raise TypeError(f"decode-0 does not take {type(request).__name__}")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def _threads(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def _until(predicate, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def leader():
    leader = Leader(answer)
    yield leader
    leader.server.close()
    assert _until(lambda: not _threads("decode-0-calls")), _threads("decode-0-calls")


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
        assert _until(lambda: not _threads("decode-0-calls-in"))
    finally:
        old.server.close()
        new.server.close()


def test_a_wrong_token_runs_nothing(leader):
    host, port, token = leader.open_calls()
    ran = []
    leader.handle = ran.append
    with socket.create_connection((host, port), timeout=WAIT_S) as conn:
        conn.sendall(frame(bytes(16)) + frame(LEN.pack(0) + pickle.dumps(Abort("r"))))
        assert conn.recv(1) == b""  # NOTE: closed without an answer
    assert ran == []


def test_close_ends_every_thread_and_refuses_new_connections():
    entered, release = threading.Event(), threading.Event()

    def hang(request):
        entered.set()
        release.wait(WAIT_S)
        return True

    leader = Leader(hang, name="prefill-7")

    async def go():
        client = LeaderClient("prefill-7", "prefill", Remote(leader), 10.0, calls="socket")
        try:
            call = asyncio.ensure_future(client.call(Abort("x")))
            assert await asyncio.to_thread(entered.wait, WAIT_S)
            await asyncio.to_thread(leader.server.close)
            with pytest.raises(LeaderError, match="CallConnectionLost"):
                await call
            with pytest.raises(LeaderError, match="leader call server is closed"):
                await client.call(Abort("y"))
        finally:
            release.set()
            await client.close()

    run(go())
    assert _until(lambda: not _threads("prefill-7-calls")), _threads("prefill-7-calls")


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


def test_a_malformed_frame_ends_only_its_connection(leader):
    """A call frame too short for its id closes that connection; the server goes on."""
    host, port, token = leader.open_calls()
    with socket.create_connection((host, port), timeout=WAIT_S) as conn:
        conn.sendall(frame(bytes(token)) + frame(b"\x01\x02"))
        assert conn.recv(1) == b""

    async def go():
        client = LeaderClient("decode-0", "decode", Remote(leader), 5.0, calls="socket")
        try:
            return await client.call(Abort("r9"))
        finally:
            await client.close()
    assert run(go()) is True


def test_a_reader_waits_on_a_descriptor_past_select_s_limit(leader):
    """The connection's reader waits with poll(): a rank process may hold more than 1024
    descriptors, which select() refuses."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit ({hard}) is below 1200")
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1200, hard))
    held = []
    try:
        while not held or held[-1].fileno() < 1100:
            held.append(socket.socket())

        async def go():
            client = LeaderClient("decode-0", "decode", Remote(leader), 5.0, calls="socket")
            try:
                return [await client.call(Abort(rid)) for rid in ("r1", "x1")]
            finally:
                await client.close()
        assert run(go()) == [True, False]
    finally:
        for sock in held:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_accept_loop_outlives_a_descriptor_shortage(leader):
    """accept() failing (EMFILE: the rank process out of descriptors for a moment) must not end
    the call server: once descriptors are free again the queued connection is taken and a
    router's later connection too (else every call to the leader hangs to its timeout)."""
    host, port, token = leader.open_calls()
    with connect_during_shortage(host, port) as queued:
        queued.settimeout(WAIT_S)
        queued.sendall(frame(bytes(token)) + frame(LEN.pack(7) + pickle.dumps(Abort("r1"))))
        (size,) = LEN.unpack(queued.recv(LEN.size, socket.MSG_WAITALL))
        body = queued.recv(size, socket.MSG_WAITALL)
        assert LEN.unpack_from(body) == (7,) and pickle.loads(body[LEN.size + 1:]) is True

    async def go():
        client = LeaderClient("decode-0", "decode", Remote(leader), 5.0, calls="socket")
        try:
            return await client.call(Abort("r2"))
        finally:
            await client.close()
    assert run(go()) is True


def test_a_hello_sent_a_byte_at_a_time_is_bounded_as_a_whole(leader, monkeypatch):
    """An unauthenticated peer that drips its hello cannot hold a server thread past
    HELLO_TIMEOUT_S (a bound per recv would let 24 bytes take 24 times it)."""
    import rank.call_server as call_server

    monkeypatch.setattr(call_server, "HELLO_TIMEOUT_S", 0.5)
    host, port, token = leader.open_calls()
    closed = seconds_until_closed(host, port, frame(bytes(16)), every_s=0.15)  # 24 x 0.15 s
    assert closed is not None and closed < 1.5, closed

"""The leader's call server (rank/call_server.py) against bad callers and its own close: a
wrong token runs nothing, a malformed frame ends only its connection, a dripped hello is
bounded as a whole, close ends every thread and refuses new connections, a reader waits on any
descriptor number and the accept loop outlives a descriptor shortage."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading

import pytest

from rank.call_server import LEN, frame
from rank.messages import Abort
from orchestrator.router.leader import LeaderClient, LeaderError
from tests.orchestrator.descriptors import connect_during_shortage
from tests.orchestrator.drip import seconds_until_closed
from tests.orchestrator.call_fakes import WAIT_S, Leader, leader, run, threads_named, until
from tests.orchestrator.fakes import Remote

__all__ = ["leader"]  # NOTE: the fixture, used by name


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
    assert until(lambda: not threads_named("prefill-7-calls")), threads_named("prefill-7-calls")


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

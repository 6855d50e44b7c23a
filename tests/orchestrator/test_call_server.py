"""The leader's call server (rank/call_server.py) against bad callers and its own close: a
wrong token runs nothing, a malformed frame ends only its connection, close ends every thread
and refuses new connections, and a reader waits on any descriptor number."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading

import pytest

from rank.call_server import LEN, frame
from rank.messages import Abort
from orchestrator.router.leader import LeaderClient, LeaderError
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

"""Router admission and shutdown edges through a real grpc.aio server over fake leaders:
Abort of a request still waiting for KV blocks, stop with queued and stuck requests, and a
second server refused on a taken port."""

from __future__ import annotations

import threading

import grpc
import pytest

from orchestrator.api.client import OrchClient
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_router import _calls, _wait_for


def test_abort_rpc_ends_a_request_waiting_for_kv_blocks():
    h = Harness(decode_capacity=0, max_pending=4, request_timeout_s=10.0)
    try:
        # NOTE: no fallback poll within the test: only the abort itself may end the wait.
        h.call_in_loop(lambda: setattr(h.router.flow.admission, "retry_s", 60.0))
        with OrchClient(h.address) as client:
            stream = client.generate(token_ids=[3], request_id="queued", max_tokens=2)
            result = {}
            t = threading.Thread(target=lambda: result.update(chunks=list(stream)),
                                 daemon=True)
            t.start()
            assert _wait_for(lambda: h.call_in_loop(lambda: h.router.flow.admission.waiting) == 1)
            assert client.abort("queued")
            t.join(5)
            assert not t.is_alive()
        (last,) = result["chunks"]
        assert last.finish_reason == "abort" and last.token_ids == ()
        assert last.stats.completion_tokens == 0 and last.stats.decode_instance == ""
        assert h.call_in_loop(lambda: h.router.flow.admission.waiting) == 0
        assert h.metrics.finished == [("abort", 1, 0)]
    finally:
        h.close()


def test_stop_ends_queued_requests_at_once_and_stuck_ones_after_the_drain():
    import asyncio
    import time

    h = Harness(decode_capacity=1, max_pending=4, request_timeout_s=30.0)
    try:
        h.call_in_loop(lambda: setattr(h.router.flow.admission, "retry_s", 60.0))
        h.call_in_loop(lambda: setattr(h.fakes["prefill-0"], "silent", True))
        with OrchClient(h.address) as client:
            streams = [client.generate(token_ids=[i + 2], max_tokens=3) for i in range(2)]
            errors = {}
            threads = [threading.Thread(target=lambda i=i, s=s: errors.update({i: _error_of(s)}),
                                        daemon=True) for i, s in enumerate(streams)]
            threads[0].start()
            assert _wait_for(lambda: len(_calls(h, "decode-0")) == 1)  # holds the only slot
            threads[1].start()
            assert _wait_for(lambda: h.call_in_loop(lambda: h.router.flow.admission.waiting) == 1)
            start = time.monotonic()
            stopping = asyncio.run_coroutine_threadsafe(h.server.stop(grace_s=1.0), h.loop)
            stopping.result(20)
            for t in threads:
                t.join(5)
            assert time.monotonic() - start < 15
        codes = sorted(e.code().name for e in errors.values())
        assert codes == ["UNAVAILABLE", "UNAVAILABLE"]
        assert any("before this request got KV blocks" in e.details() for e in errors.values())
        stuck = next(e.details() for e in errors.values() if "drain limit 1 s" in e.details())
        assert "failed: the router shut down" in stuck, stuck  # no empty "on <instance>"
    finally:
        h.loop.call_soon_threadsafe(h.loop.stop)
        h.thread.join(5)


def test_second_server_on_the_same_port_is_refused():
    import asyncio

    from orchestrator.deploy.assemble import build_board
    from orchestrator.api.server import OrchServer, PortInUseError

    h = Harness()
    try:
        port = int(h.address.rsplit(":", 1)[1])

        async def start_second():
            board = build_board(h.cfg, h.router, h.monitor)
            await OrchServer(h.router, board, "127.0.0.1", port).start()

        with pytest.raises(PortInUseError, match="pick a free router.port"):
            asyncio.run_coroutine_threadsafe(start_second(), h.loop).result(10)
    finally:
        h.close()


def _error_of(stream):
    """Drain a stream; the RpcError that ended it (None when it finished)."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as err:
        return err
    return None

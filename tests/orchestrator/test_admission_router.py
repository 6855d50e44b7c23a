"""Admission through the router: a real grpc.aio server over fake leaders. Requests that wait
for decode blocks are admitted in arrival order with no polling calls, a stream migrating off
a failed decode goes ahead of a new arrival, and a grant whose reserve call fails waits for
the next report."""

from __future__ import annotations

import threading
import time

import grpc

from orchestrator.api.client import OrchClient
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_admission import PROMPT_S
from tests.orchestrator.test_router import _wait_for


def test_waiting_requests_are_admitted_in_arrival_order_when_blocks_free():
    """End to end over fake leaders (decode: one request at a time): requests that arrive
    while decode is full get their first tokens in arrival order, and waiting costs no
    calls: one reserve per request, plus one refused for the first that found it full."""
    h = Harness(decode_capacity=1, max_pending=8, request_timeout_s=20.0)
    try:
        decode = h.fakes["decode-0"]
        entered, release = h.call_in_loop(lambda: decode.hold("admit"))
        results: dict[str, list] = {}
        firsts: list[str] = []
        lock = threading.Lock()

        def run(rid: str) -> None:
            with OrchClient(h.address) as client:
                chunks = []
                for chunk in client.generate(token_ids=[3, 4, 5], request_id=rid,
                                             max_tokens=4):
                    if not chunks:
                        with lock:
                            firsts.append(rid)
                    chunks.append(chunk)
                results[rid] = chunks

        threads = [threading.Thread(target=run, args=("r0",), daemon=True)]
        threads[0].start()
        h.run(entered.wait())  # r0 holds the only slot
        for i in range(1, 5):
            threads.append(threading.Thread(target=run, args=(f"r{i}",), daemon=True))
            threads[-1].start()
            deadline = time.monotonic() + 5
            while h.call_in_loop(lambda: h.router.flow.admission.waiting) < i:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        time.sleep(0.3)  # a polling queue would retry now
        reserves_while_waiting = [c for c in decode.calls if c[0] == "reserve"]
        h.call_in_loop(release.set)
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        h.close()
    order = [f"r{i}" for i in range(5)]
    assert firsts == order
    for rid in order:
        assert [t for c in results[rid] for t in c.token_ids] == expected_tokens((3, 4, 5), 4)
    assert [c[1] for c in reserves_while_waiting] == ["r0@1", "r1@2"]
    reserved = [c[1] for c in decode.calls if c[0] == "reserve"]
    assert reserved == ["r0@1", "r1@2", "r1@2", "r2@3", "r3@4", "r4@5"]


def test_a_migrating_stream_gets_the_freed_decode_before_a_new_arrival():
    """decode-0 holds stream m, decode-1 is full and new request n waits for blocks; decode-0
    fails: m (1 token streamed) queues ahead of n, so when decode-1 reports room m is admitted
    there first and both complete."""
    h = Harness(decode_dp=2, request_timeout_s=30.0, max_pending=8)
    try:
        d0, d1 = h.fakes["decode-0"], h.fakes["decode-1"]
        h.call_in_loop(lambda: setattr(d1, "capacity", 0))
        entered, release = h.call_in_loop(lambda: d0.hold("admit"))
        queue = h.router.flow.admission
        outputs: dict[str, list[int]] = {}

        def run(rid: str) -> None:
            with OrchClient(h.address) as client:
                outputs[rid] = [t for c in client.generate(token_ids=[3, 4, 5], request_id=rid,
                                                           max_tokens=4) for t in c.token_ids]
        streams = [threading.Thread(target=run, args=("m",), daemon=True)]
        streams[0].start()
        h.run(entered.wait())  # m streamed its first token and sits on decode-0
        h.call_in_loop(lambda: setattr(d0, "capacity", 1))  # decode-0 full too
        streams.append(threading.Thread(target=run, args=("n",), daemon=True))
        streams[1].start()
        assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 1)
        h.set_healthy(lambda name: name != "decode-0")
        h.call_in_loop(lambda: h.router.fleet.instance_failed("decode-0", "process gone"))
        assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 2)
        order = h.call_in_loop(lambda: [w.request_id for w in queue._queue])
        h.call_in_loop(lambda: setattr(d1, "capacity", 1))
        h.call_in_loop(lambda: d1.stream.flush(d1.free_blocks()))  # decode-1 reports room
        for t in streams:
            t.join(20)
        h.call_in_loop(release.set)
    finally:
        h.close()
    assert order[0].startswith("m") and order[1].startswith("n"), order
    assert [c[1] for c in d1.calls if c[0] == "admit"][0].startswith("m")
    assert outputs == {rid: expected_tokens((3, 4, 5), 4) for rid in ("m", "n")}


def test_a_granted_waiter_whose_decode_call_fails_waits_for_the_next_report():
    """A waiter granted an instance whose reserve call then fails keeps its place and is
    admitted on the next report (it used to fail: the failure's message was taken for the
    blocks it needs)."""
    h = Harness(decode_capacity=1, max_pending=8, request_timeout_s=20.0)
    try:
        decode = h.fakes["decode-0"]
        queue = h.router.flow.admission
        entered, release = h.call_in_loop(lambda: decode.hold("admit"))
        outputs: dict[str, list[int]] = {}

        def run(rid: str) -> None:
            with OrchClient(h.address) as client:
                outputs[rid] = [t for c in client.generate(token_ids=[3, 4, 5], request_id=rid,
                                                           max_tokens=4) for t in c.token_ids]
        threads = [threading.Thread(target=run, args=(rid,), daemon=True)
                   for rid in ("r0", "r1")]
        threads[0].start()
        h.run(entered.wait())
        threads[1].start()
        assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 1)

        def room(capacity: int) -> None:
            decode.capacity = capacity
            decode.flush()
        h.call_in_loop(lambda: decode.errors.__setitem__("reserve", "reserve broke"))
        h.call_in_loop(lambda: room(3))  # 2 free (1 last reported): granted; the call fails

        def reserves() -> int:
            return sum(c[0] == "reserve" for c in decode.calls)
        # NOTE: well inside HEAD_RECHECK_S: the reports, not the liveness guard, grant
        assert _wait_for(lambda: reserves() == 3, PROMPT_S)
        h.call_in_loop(lambda: decode.errors.pop("reserve"))
        h.call_in_loop(lambda: room(4))
        assert _wait_for(lambda: reserves() == 4, PROMPT_S)
        h.call_in_loop(release.set)
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        h.close()
    assert outputs == {rid: expected_tokens((3, 4, 5), 4) for rid in ("r0", "r1")}


def test_waiters_end_at_once_when_the_prefill_role_is_gone_for_good():
    """Requests waiting for decode room while the only prefill instance turns unhealthy with
    no restart coming (recovery off) end UNAVAILABLE at once, not at their deadline; the one
    already decoding finishes."""
    h = Harness(decode_capacity=1, max_pending=8, request_timeout_s=20.0)
    try:
        decode = h.fakes["decode-0"]
        entered, release = h.call_in_loop(lambda: decode.hold("admit"))
        outcomes: dict[str, object] = {}

        def run(rid: str) -> None:
            try:
                with OrchClient(h.address) as client:
                    outcomes[rid] = [t for c in client.generate(
                        token_ids=[3, 4, 5], request_id=rid, max_tokens=4) for t in c.token_ids]
            except grpc.RpcError as err:
                outcomes[rid] = err

        threads = [threading.Thread(target=run, args=(f"r{i}",), daemon=True) for i in range(3)]
        threads[0].start()
        h.run(entered.wait())  # r0 holds the only slot
        for i, t in enumerate(threads[1:], 1):
            t.start()
            assert _wait_for(lambda i=i: h.call_in_loop(
                lambda: h.router.flow.admission.waiting) == i)
        start = time.monotonic()
        h.call_in_loop(lambda: h.monitor.report_failure("prefill-0", "rank 0 is gone"))
        for t in threads[1:]:
            t.join(3)
            assert not t.is_alive()
        assert time.monotonic() - start < 3.0  # not the 20 s deadline
        for rid in ("r1", "r2"):
            assert outcomes[rid].code() == grpc.StatusCode.UNAVAILABLE
            assert "no healthy prefill instance (prefill-0 out of service) and none is being " \
                   "restarted (prefill-0: rank 0 is gone" in outcomes[rid].details()
        h.call_in_loop(release.set)
        threads[0].join(5)
        assert outcomes["r0"] == expected_tokens((3, 4, 5), 4)
        assert _wait_for(lambda: h.call_in_loop(
            lambda: h.router.in_flight == 0 and decode.reserved == {}))
    finally:
        h.close()

"""``router.reserve_after_first_token`` (with eager prefill): the prefill call is the only call
before the first token, which streams as soon as it reaches the router; decode's reserve,
``Attach`` and ``Admit`` come after it. A first token that ends the request needs no
reservation; an abort or a failure during the late reservation frees every block once (fake
leaders)."""

from __future__ import annotations

import threading

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.config.load import load_config
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_eager_prefill_router import _calls, _wait_for


def _late(**kwargs) -> Harness:
    return Harness(eager_prefill=True, reserve_after_first_token=True, **kwargs)


def _freed(h: Harness, *decodes: str) -> bool:
    return _wait_for(lambda: h.call_in_loop(
        lambda: h.router.in_flight == 0
        and all(h.fakes[d].reserved == {} for d in decodes)
        and set(h.router.flow.policy.outstanding.values()) == {0}
        and set(h.router.flow.prefill_policy.outstanding.values()) == {0}))


def _stream(h: Harness, got: dict, rid: str, prompt, max_tokens: int) -> threading.Thread:
    def run():
        with OrchClient(h.address) as client:
            try:
                for chunk in client.generate(token_ids=list(prompt), max_tokens=max_tokens,
                                             request_id=rid):
                    got.setdefault("chunks", []).append(chunk)
            except grpc.RpcError as exc:
                got["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_key_needs_eager_prefill(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "configs" / "1p1d.yaml"
    with pytest.raises(Exception, match="reserve_after_first_token needs router.eager_prefill"):
        load_config(path, {"router.eager_prefill": False,
                           "router.reserve_after_first_token": True})


def test_the_first_token_streams_before_decode_reserves():
    h = _late()
    try:
        entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("reserve"))
        got: dict = {}
        client = _stream(h, got, "l1", (5, 6, 7), 5)
        h.run(entered.wait())  # NOTE: reserve is held: the first token must be out already
        assert _wait_for(lambda: len(got.get("chunks", ())) == 1)
        assert _calls(h, "prefill-0") == [("prefill", "l1@1", None)]
        h.call_in_loop(release.set)
        client.join(10)
        chunks = got["chunks"]
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((5, 6, 7), 5)
        assert _calls(h, "prefill-0") == [("prefill", "l1@1", None),
                                          ("attach", "l1@1", "decode-0")]
        assert ("reserve", "l1@1") in _calls(h, "decode-0")
        stats = chunks[-1].stats
        assert stats.decode_instance == "decode-0" and stats.prefill_instance == "prefill-0"
        phases = dict(stats.ttft_phases)
        assert phases["reserve_wait"] == 0.0
        assert sum(phases.values()) == pytest.approx(stats.ttft_s + phases["tokenize"],
                                                     abs=0.02)
        assert _freed(h, "decode-0")
    finally:
        h.close()


def test_a_request_done_at_its_first_token_never_reserves():
    h = _late()
    try:
        with OrchClient(h.address) as client:
            chunks = list(client.generate(token_ids=[5, 6], max_tokens=1, request_id="one"))
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((5, 6), 1)
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].stats.decode_instance == ""
        assert _wait_for(lambda: ("abort", "one@1") in _calls(h, "prefill-0"))
        assert _calls(h, "decode-0") == []
        assert _freed(h, "decode-0")
    finally:
        h.close()


def test_cancel_during_the_late_reservation_frees_it_once():
    """The client goes away while decode's reserve (after the first token) is in flight: the
    prefill's computed prompt and the reservation that lands afterwards are both aborted."""
    h = _late()
    try:
        entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("reserve"))
        with grpc.insecure_channel(h.address) as channel:
            from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
            call = orch_pb2_grpc.OrchStub(channel).Generate(orch_pb2.GenerateRequest(
                token_ids=orch_pb2.TokenIds(ids=[4, 5]), request_id="c1",
                sampling=orch_pb2.SamplingParams(max_tokens=5)))
            next(call)  # the first token
            h.run(entered.wait())
            call.cancel()
            assert _wait_for(lambda: ("abort", "c1@1") in _calls(h, "prefill-0"))
            h.call_in_loop(release.set)
        assert _wait_for(lambda: ("abort", "c1@1") in _calls(h, "decode-0"))
        assert not any(c[0] in ("attach",) for c in _calls(h, "prefill-0"))
        assert not any(c[0] == "admit" for c in _calls(h, "decode-0"))
        assert _freed(h, "decode-0")
    finally:
        h.close()


def test_a_late_reservation_that_fails_everywhere_ends_the_stream_with_an_error():
    h = _late()
    try:
        h.call_in_loop(lambda: h.fakes["decode-0"].errors.update(reserve="decode-0 is gone"))
        got: dict = {}
        _stream(h, got, "u1", (3, 4), 4).join(10)
        assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens((3, 4), 1)
        assert got["error"].code() == grpc.StatusCode.UNAVAILABLE
        assert "decode-0 is gone" in got["error"].details()
        assert ("abort", "u1@1") in _calls(h, "prefill-0")  # its computed prompt
        assert _freed(h, "decode-0")
    finally:
        h.close()


def test_a_decode_that_dies_after_the_late_reservation_migrates_the_stream():
    """The late reservation's decode dies before Admit: the first token is out, so the request
    migrates (prompt + that token, reserve first on the other decode) to the same tokens."""
    h = _late(decode_dp=2)
    try:
        got: dict = {}
        holds = {d: h.call_in_loop(lambda d=d: h.fakes[d].hold("admit"))
                 for d in ("decode-0", "decode-1")}
        client = _stream(h, got, "m1", (6, 1), 4)
        assert _wait_for(lambda: any(("attach", "m1@1", d) in _calls(h, "prefill-0")
                                     for d in holds))
        dead = next(d for d in holds if ("attach", "m1@1", d) in _calls(h, "prefill-0"))
        live = ({*holds} - {dead}).pop()
        h.run(holds[dead][0].wait())
        h.call_in_loop(lambda: h.fakes[dead].die())
        h.call_in_loop(holds[dead][1].set)
        h.call_in_loop(holds[live][1].set)
        client.join(10)
        assert "error" not in got, got
        assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens((6, 1), 4)
        assert got["chunks"][-1].stats.decode_instance == live
        assert _freed(h, live)
    finally:
        h.close()


def test_a_prompt_gone_from_the_prefill_at_the_late_attach_migrates_the_stream():
    """The prefill lost the computed prompt while decode reserved (restarted, or held past its
    bound): its Attach answers "gone", the client has its first token, so the request migrates
    (prompt + that token, reserve first) to the same tokens, not an error."""
    h = _late()
    try:
        prefill = h.fakes["prefill-0"]
        entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("reserve"))
        got: dict = {}
        client = _stream(h, got, "g1", (8, 9), 4)
        h.run(entered.wait())

        def gone():
            prefill.aborted.add("g1@1")  # NOTE: as if its instance restarted meanwhile
            h.fakes["decode-0"].hold("reserve")[1].set()  # NOTE: later reserves go through
            release.set()
        h.call_in_loop(gone)
        client.join(10)
        assert "error" not in got, got
        assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens((8, 9), 4)
        assert ("attach", "g1@1", "decode-0") in _calls(h, "prefill-0")
        assert ("prefill", "g1@2", "decode-0") in _calls(h, "prefill-0")  # reserve first
        assert ("abort", "g1@1") in _calls(h, "decode-0")  # the first late reservation
        assert _freed(h, "decode-0")
    finally:
        h.close()


def test_a_prefill_answer_later_than_the_late_attach_sends_no_second_attach():
    """The token stream brings the first token before the prefill call's answer (Ray is
    slower): the late reservation attaches; the launch, once the answer comes (here while
    that Attach is still in flight), must not attach again."""
    h = _late()
    try:
        prefill = h.fakes["prefill-0"]
        _, answer = h.call_in_loop(lambda: prefill.hold("prefill_answer"))
        attaching, attach = h.call_in_loop(lambda: prefill.hold("attach"))
        got: dict = {}
        client = _stream(h, got, "a1", (2, 3), 4)
        h.run(attaching.wait())  # NOTE: the late Attach is in flight
        h.call_in_loop(answer.set)
        assert not _wait_for(lambda: len([c for c in _calls(h, "prefill-0")
                                          if c[0] == "attach"]) > 1, timeout=0.5)
        h.call_in_loop(attach.set)
        client.join(10)
        assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens((2, 3), 4)
        assert [c for c in _calls(h, "prefill-0") if c[0] == "attach"] == [
            ("attach", "a1@1", "decode-0")]
        assert _freed(h, "decode-0")
    finally:
        h.close()


def test_once_admitted_a_prefill_failure_leaves_the_request_on_its_decode():
    """After the late reservation (reserve, Attach, Admit) the attempt watches its decode only:
    a prefill that fails then does not move a request streaming from a healthy decode."""
    h = _late()
    try:
        decode = h.fakes["decode-0"]
        _, release = h.call_in_loop(lambda: decode.hold("events"))  # the decode's tokens
        got: dict = {}
        client = _stream(h, got, "k1", (7, 7, 1), 6)
        assert _wait_for(lambda: ("admit", "k1@1") in
                         [c[:2] for c in _calls(h, "decode-0")])
        assert _wait_for(lambda: h.call_in_loop(
            lambda: h.router.pump._sources.get("k1@1") == {"decode-0"}))
        h.call_in_loop(lambda: h.router.fleet.instance_failed("prefill-0", "rank 0 is gone"))
        h.call_in_loop(release.set)
        client.join(10)
        assert "error" not in got, got
        assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens((7, 7, 1), 6)
        assert [c for c in _calls(h, "prefill-0") if c[0] == "prefill"] == [
            ("prefill", "k1@1", None)]  # not placed again
        assert _freed(h, "decode-0")
    finally:
        h.close()


def _holding_the_only_slot(h):
    """Request s1 (prompt (3, 4), 4 tokens) holds decode-0's only slot, its ``admit`` held.
    Returns (the event that releases the admit, s1's result dict, its stream thread)."""
    entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit"))
    first: dict = {}
    t1 = _stream(h, first, "s1", (3, 4), 4)
    h.run(entered.wait())
    return release, first, t1


def test_a_late_reservation_waiting_for_room_goes_on_through_a_router_stop():
    """The router stops (SIGTERM drain) while a request that streamed its first token waits
    in the admission queue for decode room: its client has a token, so it is not refused
    with the new arrivals; it gets the room once freed and finishes within the drain."""
    import asyncio
    h = _late(decode_capacity=1, max_pending=4, request_timeout_s=30.0)
    try:
        release, first, t1 = _holding_the_only_slot(h)
        # NOTE: later admits go on
        h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit")[1].set())
        second: dict = {}
        t2 = _stream(h, second, "s2", (5, 6), 4)
        assert _wait_for(lambda: len(second.get("chunks", ())) == 1)  # its first token
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.flow.admission.waiting) == 1)
        stopping = asyncio.run_coroutine_threadsafe(h.server.stop(grace_s=10.0), h.loop)
        h.call_in_loop(release.set)  # s1 finishes, its blocks go to s2
        stopping.result(20)
        t1.join(5)
        t2.join(5)
        for got, rid, prompt in ((first, "s1", (3, 4)), (second, "s2", (5, 6))):
            assert "error" not in got, (rid, got)
            assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens(prompt, 4)
    finally:
        h.loop.call_soon_threadsafe(h.loop.stop)
        h.thread.join(5)


def test_a_request_done_at_its_first_token_does_not_wait_for_decode_room():
    """max_tokens == 1 while decode is full and a late reservation waits for room: the request
    never needs decode, so it goes to the prefill at once (no reserve, no wait behind the
    waiter) and finishes while decode is still full."""
    h = _late(decode_capacity=1, max_pending=4, request_timeout_s=30.0)
    try:
        release, first, t1 = _holding_the_only_slot(h)
        second: dict = {}
        t2 = _stream(h, second, "s2", (5, 6), 4)
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.flow.admission.waiting) == 1)
        one: dict = {}
        _stream(h, one, "one", (7, 8), 1).join(10)
        assert "error" not in one, one
        assert [t for c in one["chunks"] for t in c.token_ids] == expected_tokens((7, 8), 1)
        assert not any(str(c[1]).startswith("one@") for c in _calls(h, "decode-0"))
        assert h.call_in_loop(lambda: h.router.flow.admission.waiting) == 1  # s2 still waits
        h.call_in_loop(release.set)
        t1.join(10)
        t2.join(10)
        for got, prompt in ((first, (3, 4)), (second, (5, 6))):
            assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens(prompt, 4)
        assert _freed(h, "decode-0")
    finally:
        h.close()

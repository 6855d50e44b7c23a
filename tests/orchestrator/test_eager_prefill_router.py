"""``router.eager_prefill``: the router sends the prefill call before decode's reserve
answers, then the reservation with ``Attach``; the first token waits only for what is left of
the reservation; a failed or cancelled reservation aborts the prefill (fake leaders)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.config.load import load_config
from orchestrator.deploy.assemble import attaches_late
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("config, eager", [
    ("1p1d", True), ("hetero_tp_1p1d", True),
    ("mtp_1p1d", False), ("cp_1p1d", False), ("v4_1p1d", False)])
def test_eager_launch_is_refused_where_the_kv_to_ship_needs_the_step(config, eager, tmp_path,
                                                                      monkeypatch):
    """MTP's hidden state, prefill cp > 1's pieces and DeepSeek-V4's staged rows are made by
    the step that ships them: those deployments keep the reserve-first launch."""
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # NOTE: no checkpoint is written
    path = Path(__file__).resolve().parents[2] / "configs" / f"{config}.yaml"
    assert attaches_late(load_config(path, {"router.eager_prefill": True})) is eager
    assert attaches_late(load_config(path, {"router.eager_prefill": False,
                                            "router.reserve_after_first_token": False})) is False


def _calls(h, name):
    return h.call_in_loop(lambda: list(h.fakes[name].calls))


def test_prefill_goes_out_before_the_reservation_and_the_token_waits_for_it():
    h = Harness(eager_prefill=True)
    try:
        entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("reserve"))
        got = {}

        def run():
            with OrchClient(h.address) as client:
                got["chunks"] = list(client.generate(token_ids=[5, 6, 7], max_tokens=5,
                                                     request_id="e1"))

        client = threading.Thread(target=run)
        client.start()
        assert _wait_for(lambda: ("prefill", "e1@1", None) in _calls(h, "prefill-0"))
        assert _wait_for(lambda: ("reserve", "e1@1") in _calls(h, "decode-0"))
        time.sleep(0.2)  # the first token is at the router by now: it waits for the reserve
        assert "chunks" not in got
        h.call_in_loop(release.set)
        client.join(10)
        chunks = got["chunks"]
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((5, 6, 7), 5)
        assert _calls(h, "prefill-0") == [("prefill", "e1@1", None),
                                          ("attach", "e1@1", "decode-0")]
        stats = chunks[-1].stats
        phases = dict(stats.ttft_phases)
        assert phases["reserve_wait"] >= 0.15
        # NOTE: the phases span opened -> first chunk out; ttft_s starts after tokenize
        assert sum(phases.values()) == pytest.approx(stats.ttft_s + phases["tokenize"],
                                                     abs=0.02)
    finally:
        h.close()


class _SendOrder:
    """A leader handle that notes in ``sent`` when each ``request`` actor call is SENT (the
    ``.remote(...)`` call), not when it runs: (instance, request type)."""

    def __init__(self, handle, name: str, sent: list) -> None:
        self._handle, self._name, self._sent = handle, name, sent

    def __getattr__(self, attr):
        return getattr(self._handle, attr)

    @property
    def request(self):
        outer = self

        class _Method:
            @staticmethod
            def remote(req):
                outer._sent.append((outer._name, type(req).__name__))
                return outer._handle.request.remote(req)
        return _Method


def test_the_prefill_call_is_sent_before_the_reserve():
    """The prompt's compute starts one actor-call send earlier: the prefill call leaves the
    router before decode's reserve (each send costs the router ~0.5-1 ms of CPU here)."""
    h = Harness(eager_prefill=True)
    sent: list = []
    try:
        def wrap():
            for name in ("prefill-0", "decode-0"):
                leader = h.router.flow.leader(name)
                leader.handle = _SendOrder(leader.handle, name, sent)
        h.call_in_loop(wrap)
        with OrchClient(h.address) as client:
            chunks = list(client.generate(token_ids=[5, 6, 7], max_tokens=3, request_id="o1"))
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((5, 6, 7), 3)
        assert sent[:2] == [("prefill-0", "Prefill"), ("decode-0", "Reserve")]
        assert ("prefill-0", "Attach") in sent and ("decode-0", "Admit") in sent
    finally:
        h.close()


def test_a_request_that_never_fits_aborts_its_eager_prefill():
    h = Harness(never_fits=True, eager_prefill=True)
    try:
        with OrchClient(h.address) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate(token_ids=[3], max_tokens=2, request_id="big"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("prefill", "big@1", None) in _calls(h, "prefill-0")
        assert ("abort", "big@1") in _calls(h, "prefill-0")
        assert not any(c[0] == "attach" for c in _calls(h, "prefill-0"))
    finally:
        h.close()


def test_cancel_while_reserving_aborts_prefill_and_decode():
    h = Harness(eager_prefill=True)
    try:
        entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("reserve"))
        with grpc.insecure_channel(h.address) as channel:
            from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
            call = orch_pb2_grpc.OrchStub(channel).Generate(orch_pb2.GenerateRequest(
                token_ids=orch_pb2.TokenIds(ids=[4, 5]), request_id="c1",
                sampling=orch_pb2.SamplingParams(max_tokens=5)))
            assert _wait_for(lambda: ("reserve", "c1@1") in _calls(h, "decode-0"))
            call.cancel()
            assert _wait_for(lambda: ("abort", "c1@1") in _calls(h, "prefill-0"))
            h.call_in_loop(release.set)
        assert _wait_for(lambda: ("abort", "c1@1") in _calls(h, "decode-0"))
        assert _wait_for(lambda: h.call_in_loop(lambda: dict(h.fakes["decode-0"].reserved))
                         == {})
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.in_flight) == 0)
    finally:
        h.close()


def test_eager_stays_off_while_requests_wait_for_decode_room():
    """With a request queued for decode blocks, the next one reserves first (its prompt
    would otherwise hold prefill blocks through the wait)."""
    h = Harness(decode_capacity=0, max_pending=4, request_timeout_s=1.0, eager_prefill=True)
    try:
        results = []

        def run(rid):
            with OrchClient(h.address) as client:
                try:
                    list(client.generate(token_ids=[3], max_tokens=2, request_id=rid))
                except grpc.RpcError as exc:
                    results.append(exc.code())

        first = threading.Thread(target=run, args=("w1",))
        first.start()
        assert _wait_for(lambda: ("reserve", "w1@1") in _calls(h, "decode-0"))
        time.sleep(0.1)  # w1 waits in the admission queue now
        run("w2")
        first.join(10)
        prefills = [c for c in _calls(h, "prefill-0") if c[0] == "prefill"]
        assert ("prefill", "w1@1", None) in prefills  # the first went out eagerly
        assert not any(c[1] == "w2@1" for c in prefills)  # the second waited behind it
        assert ("abort", "w1@1") in _calls(h, "prefill-0")  # its wait timed out
        assert results == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    finally:
        h.close()


def test_a_request_done_at_its_first_token_aborts_its_eager_prefill_and_reservation():
    """max_tokens=1: the prompt computed before the reservation is freed on the prefill (an
    Attach that got there first has its sends stopped by the same abort), the reservation on
    decode; the stream ends with the one token."""
    h = Harness(eager_prefill=True)
    try:
        with OrchClient(h.address) as client:
            chunks = list(client.generate(token_ids=[5, 6], max_tokens=1, request_id="one"))
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((5, 6), 1)
        assert chunks[-1].finish_reason == "length"
        assert _wait_for(lambda: ("abort", "one@1") in _calls(h, "prefill-0"))
        assert _wait_for(lambda: ("abort", "one@1") in _calls(h, "decode-0"))
        assert h.call_in_loop(lambda: dict(h.fakes["decode-0"].reserved)) == {}
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.in_flight) == 0)
    finally:
        h.close()


def test_an_attach_the_prefill_refuses_ends_the_request_with_an_error():
    """The prefill no longer has the prompt when its reservation comes (aborted there, or
    held past its bound): the request ends UNAVAILABLE, not waiting on decode for KV."""
    h = Harness(eager_prefill=True)
    try:
        prefill = h.fakes["prefill-0"]
        _, release_attach = h.call_in_loop(lambda: prefill.hold("attach"))
        _, release_admit = h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit"))
        got = {}

        def run():
            with OrchClient(h.address) as client:
                try:
                    got["chunks"] = list(client.generate(token_ids=[8, 9], max_tokens=4,
                                                         request_id="g1"))
                except grpc.RpcError as exc:
                    got["error"] = exc

        client = threading.Thread(target=run)
        client.start()
        assert _wait_for(lambda: ("attach", "g1@1", "decode-0") in _calls(h, "prefill-0"))

        def gone():
            prefill.aborted.add("g1@1")  # NOTE: as if ended there (expired, say)
            release_attach.set()
        h.call_in_loop(gone)
        client.join(10)
        h.call_in_loop(release_admit.set)
        assert "error" in got, got
        assert got["error"].code() == grpc.StatusCode.UNAVAILABLE
        assert "gone when its decode reservation was attached" in got["error"].details()
        assert _wait_for(lambda: ("abort", "g1@1") in _calls(h, "decode-0"))
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.in_flight) == 0)
    finally:
        h.close()


def test_a_prefill_that_dies_before_its_attach_moves_the_request():
    """The prompt went out to one prefill, which computed its first token and dies while
    decode reserves: the Attach fails, so decode would never get the KV: the request moves
    (its first token already streamed: a migration, to the other prefill, its reservation
    on decode aborted) and ends with the same tokens."""
    h = Harness(eager_prefill=True, prefill_dp=2)
    try:
        decode = h.fakes["decode-0"]
        _, release_reserve = h.call_in_loop(lambda: decode.hold("reserve"))
        _, release_admit = h.call_in_loop(lambda: decode.hold("admit"))
        got = {}

        def run():
            with OrchClient(h.address) as client:
                got["chunks"] = list(client.generate(token_ids=[4, 4, 2], max_tokens=4,
                                                     request_id="d1"))

        names = ("prefill-0", "prefill-1")
        client = threading.Thread(target=run)
        client.start()
        assert _wait_for(lambda: ("reserve", "d1@1") in _calls(h, "decode-0"))
        first = next(n for n in names if ("prefill", "d1@1", None) in _calls(h, n))
        other = ({*names} - {first}).pop()
        time.sleep(0.2)  # NOTE: its first token is out (the fake emits it in the call)
        h.call_in_loop(lambda: h.fakes[first].die())
        h.call_in_loop(release_reserve.set)
        # NOTE: a resumed request (tokens streamed) reserves first: the normal path
        assert _wait_for(lambda: ("prefill", "d1@2", "decode-0") in _calls(h, other))
        h.call_in_loop(release_admit.set)
        client.join(10)
        chunks = got["chunks"]
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((4, 4, 2), 4)
        assert not any(c[0] == "attach" for c in _calls(h, other))
        assert ("abort", "d1@1") in _calls(h, "decode-0")
        assert _wait_for(lambda: h.call_in_loop(lambda: dict(decode.reserved)) == {})
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.in_flight) == 0)
    finally:
        h.close()


def test_a_decode_that_dies_before_the_attach_places_the_request_again():
    """The reservation's decode dies before the first token reached the router (its Attach
    on the way): the attempt fails, the prefill is aborted (its computed prompt freed there),
    and the retry reserves on the other decode, eagerly again, to the same tokens."""
    h = Harness(eager_prefill=True, decode_dp=2)
    try:
        prefill = h.fakes["prefill-0"]
        entered, release = h.call_in_loop(lambda: prefill.hold("attach"))
        _, release_events = h.call_in_loop(lambda: prefill.hold("events"))  # the first token
        got = {}

        def run():
            with OrchClient(h.address) as client:
                got["chunks"] = list(client.generate(token_ids=[6, 1], max_tokens=4,
                                                     request_id="x1"))

        client = threading.Thread(target=run)
        client.start()
        h.run(entered.wait())
        dead = next(c[2] for c in _calls(h, "prefill-0") if c[:2] == ("attach", "x1@1"))
        h.call_in_loop(lambda: h.fakes[dead].die())
        assert _wait_for(lambda: ("abort", "x1@1") in _calls(h, "prefill-0"))
        h.call_in_loop(release.set)
        h.call_in_loop(release_events.set)
        client.join(10)
        assert [t for c in got["chunks"] for t in c.token_ids] == expected_tokens((6, 1), 4)
        calls = _calls(h, "prefill-0")
        assert ("abort", "x1@1") in calls
        live = ({"decode-0", "decode-1"} - {dead}).pop()
        assert ("prefill", "x1@2", None) in calls and ("attach", "x1@2", live) in calls
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.in_flight) == 0)
    finally:
        h.close()

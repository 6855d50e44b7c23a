"""Aborts win whenever they arrive, and a reused request id never sees another request's
events: a real grpc.aio server over fake leaders, each stage held with the fakes' ``hold``
(no sleeps decide the order)."""

from __future__ import annotations

import threading

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import TOKENIZER, Harness
from tests.orchestrator.test_router import _calls, _wait_for


class HeldTokenizer:
    """The harness tokenizer whose ``encode`` waits until ``release`` is set."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        assert self.release.wait(10)
        return TOKENIZER.encode(text)

    def __getattr__(self, name):
        return getattr(TOKENIZER, name)


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def _stream_in_thread(client, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}
    stream = client.generate(**kwargs)
    thread = threading.Thread(target=lambda: result.update(chunks=list(stream)), daemon=True)
    thread.start()
    return thread, result


def _nothing_left(h: Harness) -> bool:
    def check():
        return (h.router.in_flight == 0 and h.fakes["decode-0"].reserved == {}
                and set(h.router.flow.policy.outstanding.values()) == {0}
                and set(h.router.flow.prefill_policy.outstanding.values()) == {0})
    return _wait_for(lambda: h.call_in_loop(check))


def _ends_with_abort(thread: threading.Thread, result: dict, h: Harness) -> None:
    thread.join(5)
    assert not thread.is_alive()
    last = result["chunks"][-1]
    assert last.finish_reason == "abort", result["chunks"]
    assert _nothing_left(h)
    assert h.metrics.finished[-1][0] == "abort"


def test_abort_while_tokenizing_wins(harness):
    held = HeldTokenizer()
    harness.call_in_loop(lambda: setattr(harness.router, "tokenizer", held))
    with OrchClient(harness.address) as client:
        thread, result = _stream_in_thread(client, prompt="abort me early", request_id="t",
                                           max_tokens=50)
        assert held.entered.wait(5)
        assert client.abort("t") is True  # known from acceptance, not only once placed
        held.release.set()
        _ends_with_abort(thread, result, harness)
    assert result["chunks"][-1].token_ids == ()
    assert _calls(harness, "decode-0") == [] and _calls(harness, "prefill-0") == []


def test_client_gone_while_tokenizing_is_reported_once_as_cancelled(harness):
    held = HeldTokenizer()
    harness.call_in_loop(lambda: setattr(harness.router, "tokenizer", held))
    with grpc.insecure_channel(harness.address) as channel:
        call = orch_pb2_grpc.OrchStub(channel).Generate(orch_pb2.GenerateRequest(
            text="gone early", request_id="g", sampling=orch_pb2.SamplingParams(max_tokens=5)))
        assert held.entered.wait(5)
        call.cancel()
        assert _wait_for(lambda: harness.call_in_loop(lambda: harness.router.in_flight) == 0)
    held.release.set()
    assert harness.metrics.finished == [("cancelled", 0, 0)]
    assert harness.metrics.rejected == []
    assert _calls(harness, "decode-0") == [] and _calls(harness, "prefill-0") == []


@pytest.mark.parametrize("method", ["reserve", "prefill"])
def test_abort_while_a_call_is_in_flight_wins(harness, method):
    """reserve: the reservation made after the abort is freed, prefill never starts;
    prefill: the launched request is aborted on both sides."""
    fake = harness.fakes["decode-0" if method == "reserve" else "prefill-0"]
    entered, release = harness.call_in_loop(lambda: fake.hold(method))
    with OrchClient(harness.address) as client:
        thread, result = _stream_in_thread(client, token_ids=[4, 5], request_id="r",
                                           max_tokens=50)
        harness.run(entered.wait())
        assert client.abort("r") is True
        harness.call_in_loop(release.set)
        _ends_with_abort(thread, result, harness)
    assert [t for c in result["chunks"] for t in c.token_ids] == []
    assert ("abort", "r@1") in _calls(harness, "decode-0")
    if method == "reserve":
        assert not any(c[0] == "prefill" for c in _calls(harness, "prefill-0"))
    else:
        assert ("abort", "r@1") in _calls(harness, "prefill-0")


def test_abort_after_the_first_token_wins_over_the_admit_in_flight(harness):
    entered, release = harness.call_in_loop(lambda: harness.fakes["decode-0"].hold("admit"))
    with OrchClient(harness.address) as client:
        stream = client.generate(token_ids=[4, 5], request_id="f", max_tokens=50)
        first = next(stream)
        assert first.token_ids == tuple(expected_tokens((4, 5), 1))
        harness.run(entered.wait())
        assert client.abort("f") is True
        harness.call_in_loop(release.set)
        rest = list(stream)
    assert [c.token_ids for c in rest] == [()] and rest[-1].finish_reason == "abort"
    assert _nothing_left(harness)
    assert ("abort", "f@1") in _calls(harness, "decode-0")


def test_abort_of_an_unknown_or_ended_request_is_not_found(harness):
    with OrchClient(harness.address) as client:
        assert client.abort("never") is False
        list(client.generate(token_ids=[4], request_id="done", max_tokens=2))
        assert client.abort("done") is False


def test_reused_id_does_not_get_the_previous_requests_late_abort(harness):
    """max_tokens=1: the first token ends the request and the router frees the decode
    reservation with an abort, whose "abort" event reaches the pump after the request ended.
    The client reuses the id at once; the late event must not end the new request."""
    decode = harness.fakes["decode-0"]
    entered, release = harness.call_in_loop(lambda: decode.hold("events"))
    with OrchClient(harness.address) as client:
        one = list(client.generate(token_ids=[5, 6, 7], request_id="same", max_tokens=1))
        assert one[-1].finish_reason == "length"
        assert _wait_for(lambda: ("abort", "same@1") in _calls(harness, "decode-0"))
        thread, result = _stream_in_thread(client, token_ids=[5, 6, 7], request_id="same",
                                           max_tokens=6)
        assert _wait_for(lambda: ("admit", "same@2", one[0].token_ids[0])
                         in _calls(harness, "decode-0"))
        harness.call_in_loop(release.set)  # the stale abort event comes out first
        thread.join(5)
    chunks = result["chunks"]
    assert chunks[-1].finish_reason == "length", chunks
    assert [t for c in chunks for t in c.token_ids] == expected_tokens((5, 6, 7), 6)
    assert _nothing_left(harness)

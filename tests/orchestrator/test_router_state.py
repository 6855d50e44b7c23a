"""One request's state on the router without a server: the phase table, the rejection rule,
token counting, the pump's Inbox and the stream's wait (failures raise, never arrive as
events)."""

from __future__ import annotations

import asyncio

import pytest

from engine.request import RequestSpec
from engine.sampling_params import SamplingParams, TokenLogprobs
from orchestrator.router.flow import Route
from orchestrator.router.event_pump import Inbox
from orchestrator.router.request import InstanceFailure, RequestError
from orchestrator.router.request_state import Phase, RequestState
from rank.messages import TokenEvent

EOS = 1


def _state(max_tokens: int = 4, ignore_eos: bool = False) -> RequestState:
    """Call on a running loop: an accepted request with prompt (5, 6, 7)."""
    req = RequestState("r", start=0.0)
    spec = RequestSpec(request_id="r", prompt_token_ids=(5, 6, 7),
                       sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
    req.accepted(spec, (EOS,), now=10.0)
    return req


def _placed(req: RequestState, number: int = 1) -> Route:
    spec = req.new_attempt(number)
    route = Route(spec.request_id, main="decode-0", prefill="prefill-0")
    req.placed(route)
    return route


def _run(coro):
    return asyncio.run(coro)


def test_a_request_walks_the_phases_and_ends_once():
    async def go():
        req = _state()
        spec = req.new_attempt(7)
        assert (req.phase, req.attempt_id, spec.request_id) == (Phase.PLACING, "r@7", "r@7")
        _placed(req, 8)
        assert req.phase is Phase.PREFILLING and req.instances == {"decode-0", "prefill-0"}
        req.decoding()
        assert req.phase is Phase.DECODING and req.instances == {"decode-0"}
        assert req.end(Phase.FINISHED) is False and req.ended
        with pytest.raises(RuntimeError, match="no transition finished -> aborted"):
            req.end(Phase.ABORTED)
        with pytest.raises(RuntimeError, match="no transition accepted -> decoding"):
            _state().decoding()
    _run(go())


def test_a_failure_is_a_rejection_only_before_anything_was_computed():
    async def go():
        assert _state().end(Phase.FAILED) is True  # validation
        assert _state().end(Phase.ABORTED) is False  # aborted while tokenizing: finished
        first = _state()
        first.new_attempt(1)
        assert first.end(Phase.FAILED) is True  # no capacity on the first placement
        again = _state()
        _placed(again)
        again.attempt_failed(InstanceFailure("prefill-0", "prefill-0 died"), max_attempts=3)
        again.new_attempt(2)
        assert again.avoid == {"prefill-0"}
        assert again.end(Phase.FAILED) is False  # an attempt already ran
    _run(go())


def test_attempts_run_out_naming_every_failure():
    async def go():
        req = _state()
        for n in (1, 2):
            _placed(req, n)
            if n == 1:
                req.attempt_failed(InstanceFailure("prefill-0", "first died"), 2)
        with pytest.raises(RequestError) as err:
            req.attempt_failed(InstanceFailure("decode-0", "second died"), 2)
        assert err.value.code == "UNAVAILABLE"
        assert "failed on 2 attempt(s) (router.max_attempts=2)" in err.value.message
        assert "attempt 1: first died; attempt 2: second died" in err.value.message
    _run(go())


def test_take_caps_at_max_tokens_and_stops_at_eos():
    async def go():
        req = _state(max_tokens=4)
        assert req.take(TokenEvent("r@1", (9,)), now=11.0) == ((9,), None)
        assert req.take(TokenEvent("r@1", (8, 7, 6, 5)), now=12.5) == ((8, 7, 6), "length")
        assert (req.completion_tokens, req.ttft(), req.tpot()) == (4, 1.0, 0.5)
        eos = _state(max_tokens=9)
        assert eos.take(TokenEvent("r@1", (3, EOS, 4)), now=11.0) == ((3, EOS), "stop")
        ignored = _state(max_tokens=9, ignore_eos=True)
        assert ignored.take(TokenEvent("r@1", (3, EOS), "abort"), now=11.0) == ((3, EOS),
                                                                                 "abort")
    _run(go())


def test_inbox_gives_events_in_order_then_raises_the_failure():
    async def go():
        inbox = Inbox("r")
        assert inbox.take() is None and not inbox.ready.done()
        inbox.put(TokenEvent("r@1", (4,), instance="prefill-0"))
        inbox.fail("decode-0", "decode-0 failed: gone")
        assert inbox.ready.done()
        assert inbox.take().token_ids == (4,)
        with pytest.raises(InstanceFailure) as err:
            inbox.take()
        assert err.value.instance == "decode-0"
        assert err.value.message == "request r failed on decode-0: decode-0 failed: gone"
        assert not inbox.ready.done()
        inbox.put(TokenEvent("r@1", (), "error", "row not finite", instance="decode-0"))
        with pytest.raises(RequestError) as own:
            inbox.take()
        assert (own.value.code, type(own.value)) == ("INTERNAL", RequestError)
    _run(go())


def test_inbox_drops_what_an_instance_no_longer_watched_queued():
    async def go():
        inbox = Inbox("r")
        inbox.put(TokenEvent("r@1", (4,), instance="prefill-0"))
        inbox.fail("prefill-0", "prefill-0 failed: gone")
        inbox.narrow({"decode-0"})
        assert inbox.take() is None and not inbox.ready.done()
    _run(go())


def _failing(instance: str):
    async def call():
        raise InstanceFailure(instance, f"{instance}.admit failed: RuntimeError: gone")
    return asyncio.ensure_future(call())


def test_a_failed_side_call_raises_in_the_wait():
    async def go():
        req = _state()
        _placed(req)
        req.calls["launch"] = _failing("prefill-0")
        with pytest.raises(InstanceFailure) as err:
            await req.next_event(Inbox("r"), timeout_s=5.0)
        assert err.value.instance == "prefill-0"
        assert err.value.message.startswith("request r failed on prefill-0: prefill-0.admit")
        assert req.calls == {}
    _run(go())


def test_a_side_call_of_an_instance_left_behind_is_ignored():
    async def go():
        req = _state()
        _placed(req)
        req.decoding()  # depends on decode-0 only
        req.calls["launch"] = _failing("prefill-0")
        inbox = Inbox("r")
        asyncio.get_running_loop().call_later(0.05, inbox.put,
                                              TokenEvent("r@1", (3,), instance="decode-0"))
        assert (await req.next_event(inbox, timeout_s=5.0)).token_ids == (3,)
    _run(go())


def test_the_wait_ends_on_abort_shutdown_and_its_deadline():
    async def go():
        req = _state()
        _placed(req)
        asyncio.get_running_loop().call_later(0.05, req.abort)
        assert await req.next_event(Inbox("r"), timeout_s=5.0) is None
        stopping = _state()
        _placed(stopping)
        asyncio.get_running_loop().call_later(
            0.05, stopping.fail, RequestError("UNAVAILABLE", "the router shut down"))
        with pytest.raises(RequestError, match="the router shut down"):
            await stopping.next_event(Inbox("r"), timeout_s=5.0)
        silent = _state()
        _placed(silent)
        with pytest.raises(RequestError) as err:
            await silent.next_event(Inbox("r"), timeout_s=0.05)
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert "['decode-0', 'prefill-0']" in err.value.message
        decoding = _state()  # NOTE: past its first token it waits on decode only
        _placed(decoding)
        decoding.decoding()
        with pytest.raises(RequestError) as err:
            await decoding.next_event(Inbox("r"), timeout_s=0.05)
        assert "no tokens from ['decode-0'] within" in err.value.message
    _run(go())


def test_inbox_merges_queued_tokens_of_one_instance_up_to_an_end_or_an_error():
    async def go():
        inbox = Inbox("r")
        for event in (TokenEvent("r@1", (1,), instance="decode-0"),
                      TokenEvent("r@1", (2, 3), instance="decode-0"),
                      TokenEvent("r@1", (4,), "length", instance="decode-0"),
                      TokenEvent("r@1", (5,), instance="decode-0")):
            inbox.put(event)
        merged, rest = inbox.take(), inbox.take()
        inbox.put(TokenEvent("r@1", (6,), instance="decode-0"))
        inbox.put(TokenEvent("r@1", (), "error", "boom", instance="decode-0"))
        before_error = inbox.take()
        with pytest.raises(RequestError, match="boom"):
            inbox.take()
        return merged, rest, before_error, inbox.take()

    merged, rest, before_error, empty = asyncio.run(go())
    assert (merged.token_ids, merged.finish_reason) == ((1, 2, 3, 4), "length")
    assert (rest.token_ids, rest.finish_reason) == ((5,), None)
    assert before_error.token_ids == (6,) and empty is None


def test_merged_token_events_keep_logprobs_and_cached_tokens():
    """A router that fell behind merges queued events of one instance: every token's logprob
    and the first event's cached prompt tokens survive the merge."""
    async def go():
        inbox = Inbox("r")
        lp = [TokenLogprobs(t, -0.5 * t, ()) for t in (4, 5, 6)]
        inbox.put(TokenEvent("r@1", (4,), instance="decode-0", num_cached_tokens=16,
                             logprobs=(lp[0],)))
        inbox.put(TokenEvent("r@1", (5, 6), instance="decode-0", logprobs=tuple(lp[1:])))
        merged = inbox.take()
        assert merged.token_ids == (4, 5, 6) and merged.logprobs == tuple(lp)
        assert merged.num_cached_tokens == 16
    _run(go())

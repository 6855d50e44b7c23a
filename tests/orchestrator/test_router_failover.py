"""Failover through a real grpc.aio server over fake leaders (two of a role where it matters):
before the first token a failed instance costs an attempt, not the request; after it the
request migrates (prompt + streamed tokens placed again, the stream goes on; UNAVAILABLE
past router.max_migrations); a request no longer depends on prefill after its first
token; the request's own error is never retried."""

from __future__ import annotations

import threading

import grpc
import pytest

from orchestrator.api.client import OrchClient
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_router import _calls, _wait_for

PROMPT = (4, 5, 6)


def _generate(h: Harness, **kwargs):
    with OrchClient(h.address) as client:
        return list(client.generate(token_ids=list(PROMPT), **kwargs))


def _all_released(h: Harness) -> bool:
    def check():
        flow = h.router.flow
        loads = [*flow.policy.outstanding.values(), *flow.prefill_policy.outstanding.values()]
        return (h.router.in_flight == 0 and set(loads) == {0}
                and all(f.reserved == {} for n, f in h.fakes.items() if n.startswith("decode")))
    return _wait_for(lambda: h.call_in_loop(check))


@pytest.fixture
def two_decodes():
    h = Harness(decode_dp=2)
    yield h
    h.close()


@pytest.fixture
def two_prefills():
    h = Harness(prefill_dp=2)
    yield h
    h.close()


def test_failed_reserve_tries_the_next_decode(two_decodes):
    h = two_decodes
    h.call_in_loop(lambda: h.fakes["decode-0"].errors.update(reserve="ActorDiedError"))
    chunks = _generate(h, request_id="a", max_tokens=5)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 5)
    assert chunks[-1].stats.decode_instance == "decode-1"
    assert _wait_for(lambda: ("abort", "a@1") in _calls(h, "decode-0"))  # it may have reserved
    assert _all_released(h)


def test_reserve_failing_everywhere_is_unavailable_naming_each(two_decodes):
    h = two_decodes
    for name in ("decode-0", "decode-1"):
        h.call_in_loop(lambda n=name: h.fakes[n].errors.update(reserve=f"{n} is gone"))
    with pytest.raises(grpc.RpcError) as err:
        _generate(h, max_tokens=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode-0 is gone" in err.value.details()
    assert "decode-1 is gone" in err.value.details()
    assert _all_released(h)


def test_failed_prefill_launch_runs_a_new_attempt_on_the_other_prefill(two_prefills):
    h = two_prefills
    h.call_in_loop(lambda: h.fakes["prefill-0"].errors.update(prefill="ActorDiedError"))
    chunks = _generate(h, request_id="p", max_tokens=5)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 5)
    assert chunks[-1].stats.prefill_instance == "prefill-1"
    assert _calls(h, "prefill-1") == [("prefill", "p@2", "decode-0")]
    assert ("abort", "p@1") in _calls(h, "decode-0")  # the first attempt's reservation
    assert _all_released(h)


def test_instance_failed_before_the_first_token_places_the_request_again(two_prefills):
    h = two_prefills
    entered, release = h.call_in_loop(lambda: h.fakes["prefill-0"].hold("prefill"))
    with OrchClient(h.address) as client:
        stream = client.generate(token_ids=list(PROMPT), request_id="h", max_tokens=4)
        chunks = []
        t = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
        t.start()
        h.run(entered.wait())  # launched on prefill-0, whose call now hangs
        h.call_in_loop(lambda: h.router.fleet.instance_failed("prefill-0", "no heartbeat for 5 s"))
        t.join(3)  # well under the 5 s call bound: the hung call is not waited for
        assert not t.is_alive()
    assert [tok for c in chunks for tok in c.token_ids] == expected_tokens(PROMPT, 4)
    assert chunks[-1].stats.prefill_instance == "prefill-1"
    assert ("abort", "h@1") in _calls(h, "prefill-0")
    h.call_in_loop(release.set)
    assert _all_released(h)


def test_unhealthy_instances_are_not_chosen(two_prefills):
    h = two_prefills
    h.set_healthy(lambda name: name != "prefill-0")
    for _ in range(3):  # round robin would start on prefill-0 every other request
        assert _generate(h, max_tokens=2)[-1].stats.prefill_instance == "prefill-1"
    assert _calls(h, "prefill-0") == []
    h.set_healthy(lambda name: name.startswith("d"))
    with pytest.raises(grpc.RpcError) as err:
        _generate(h, max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy prefill instance" in err.value.details()


def test_prefill_failure_after_the_first_token_does_not_end_the_request():
    """Fault 3: the request decodes on a healthy decode while its prefill dies."""
    h = Harness()
    try:
        entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit"))
        with OrchClient(h.address) as client:
            stream = client.generate(token_ids=list(PROMPT), max_tokens=6)
            first = next(stream)
            h.run(entered.wait())
            prefill = h.fakes["prefill-0"]
            h.call_in_loop(lambda: setattr(prefill, "poll_error", "prefill rank 0 died"))
            assert _wait_for(lambda: prefill.poll_failures > 0)
            h.call_in_loop(lambda: h.router.fleet.instance_failed("prefill-0", "process gone"))
            h.call_in_loop(release.set)
            rest = list(stream)
        assert rest[-1].finish_reason == "length"
        tokens = [t for c in [first, *rest] for t in c.token_ids]
        assert tokens == expected_tokens(PROMPT, 6)
    finally:
        h.close()


def _stream_until_decode_fails(h: Harness, request_id: str, max_tokens: int, fail=None,
                               **kwargs):
    """Stream a request until decode-0 was admitted, then fail decode-0 (``fail()``, else
    ``instance_failed``); every chunk (or the error) the stream gives after that."""
    entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit"))
    with OrchClient(h.address) as client:
        stream = client.generate(token_ids=list(PROMPT), request_id=request_id,
                                 max_tokens=max_tokens, **kwargs)
        first = next(stream)
        h.run(entered.wait())
        if fail is None:
            h.call_in_loop(lambda: h.router.fleet.instance_failed("decode-0", "process gone"))
        else:
            fail()
        try:
            rest = list(stream)
        finally:
            h.call_in_loop(release.set)
    return [first, *rest]


def test_decode_failure_after_the_first_token_migrates_the_stream(two_decodes):
    """Prompt + streamed token placed again on decode-1; the stream goes on, no token
    repeated or lost."""
    h = two_decodes
    chunks = _stream_until_decode_fails(h, "d", 6)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 6)
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].stats.completion_tokens == 6
    assert chunks[-1].stats.prompt_tokens == len(PROMPT)
    assert chunks[-1].stats.decode_instance == "decode-1"
    first = expected_tokens(PROMPT, 1)
    assert [c for c in _calls(h, "prefill-0") if c[0] == "prefill"] == [
        ("prefill", "d@1", "decode-0"), ("prefill", "d@2", "decode-1")]
    spec = h.call_in_loop(lambda: h.fakes["prefill-0"].specs["d@2"])
    assert spec.prompt_token_ids == PROMPT + tuple(first)
    assert spec.num_resumed_tokens == 1 and spec.sampling.max_tokens == 5
    assert h.metrics.migrated == 1
    assert _all_released(h)


def test_migration_keeps_the_seed(two_decodes):
    h = two_decodes
    chunks = _stream_until_decode_fails(h, "s", 4, temperature=0.8, seed=7)
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 4)
    spec = h.call_in_loop(lambda: h.fakes["prefill-0"].specs["s@2"])
    assert spec.sampling.seed == 7 and spec.num_resumed_tokens == 1
    assert _all_released(h)


def test_decode_failure_after_the_first_token_without_migration_is_unavailable():
    h = Harness(decode_dp=2, max_migrations=0)
    try:
        with pytest.raises(grpc.RpcError) as err:
            _stream_until_decode_fails(h, "d", 6)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details()
        assert "on decode-0: decode-0 failed: process gone" in details, details
        assert "after 1 token(s)" in details and "router.max_migrations=0" in details
        assert [c for c in _calls(h, "decode-1") if c[0] == "reserve"] == []  # not run again
        assert _all_released(h)
    finally:
        h.close()


def test_a_migration_that_finds_no_blocks_says_why_it_moved():
    h = Harness(decode_dp=2, request_timeout_s=1.0)
    try:
        h.call_in_loop(lambda: setattr(h.fakes["decode-1"], "capacity", 0))  # full
        with pytest.raises(grpc.RpcError) as err:
            _stream_until_decode_fails(h, "f", 6, fail=lambda: (
                h.set_healthy(lambda name: name != "decode-0"),  # NOTE: as the monitor says
                h.call_in_loop(lambda: h.router.fleet.instance_failed("decode-0", "process gone"))))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = err.value.details()
        assert "waited router.request_timeout_s for decode KV blocks" in details, details
        assert "it was being migrated after 1 streamed token(s)" in details, details
        assert "on decode-0: decode-0 failed: process gone" in details, details
        assert _all_released(h)
    finally:
        h.close()


def test_migrations_past_the_limit_name_each_failure():
    """Both decodes fail after tokens streamed: max_migrations=1 allows one move, then
    UNAVAILABLE naming both failures."""
    h = Harness(decode_dp=2, max_migrations=1)
    try:
        holds = {n: h.call_in_loop(lambda n=n: h.fakes[n].hold("admit"))
                 for n in ("decode-0", "decode-1")}
        with OrchClient(h.address) as client:
            stream = client.generate(token_ids=list(PROMPT), request_id="m", max_tokens=6)
            got = list(next(stream).token_ids)
            for name in ("decode-0", "decode-1"):
                h.run(holds[name][0].wait())
                h.call_in_loop(lambda n=name: h.router.fleet.instance_failed(n, f"{n} gone"))
                if name == "decode-0":
                    got += next(stream).token_ids  # the migrated attempt's prefill token
            with pytest.raises(grpc.RpcError) as err:
                list(stream)
        for _, release in holds.values():
            h.call_in_loop(release.set)
        assert got == expected_tokens(PROMPT, 2)
        details = err.value.details()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "decode-0 gone" in details and "decode-1 gone" in details, details
        assert "after 2 token(s)" in details and "router.max_migrations=1" in details
        assert _all_released(h)
    finally:
        h.close()


def test_the_requests_own_error_is_not_retried(two_prefills):
    h = two_prefills
    prefill = h.fakes["prefill-0"]

    def fail_it(spec, reservation):
        prefill.calls.append(("prefill", spec.request_id, reservation.decode_instance))
        prefill.emit_error(spec.request_id, "sampler row is not finite: lower the temperature")
    h.call_in_loop(lambda: setattr(prefill, "prefill", fail_it))
    with pytest.raises(grpc.RpcError) as err:
        _generate(h, request_id="own", max_tokens=3)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "sampler row is not finite" in err.value.details()
    assert _calls(h, "prefill-1") == []
    assert [c[1] for c in _calls(h, "decode-0") if c[0] == "reserve"] == ["own@1"]
    assert _all_released(h)


def test_prefill_gone_unhealthy_while_reserving_frees_the_reservation(two_prefills):
    h = two_prefills
    entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("reserve"))
    with OrchClient(h.address) as client:
        stream = client.generate(token_ids=list(PROMPT), request_id="u", max_tokens=3)
        errors = []
        t = threading.Thread(target=lambda: errors.append(_error_of(stream)), daemon=True)
        t.start()
        h.run(entered.wait())
        h.set_healthy(lambda n: n.startswith("decode"))
        h.call_in_loop(release.set)
        t.join(5)
    assert errors[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy prefill instance (prefill-0, prefill-1 out of service)" in errors[0].details()
    assert ("abort", "u@1") in _calls(h, "decode-0")
    assert _all_released(h)


def _error_of(stream):
    try:
        list(stream)
    except grpc.RpcError as err:
        return err
    return None


def test_instance_failed_abandons_a_hung_reserve_for_the_next_decode(two_decodes):
    """The reserve call on a hung decode fails at once, not at its 5 s bound."""
    h = two_decodes
    entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("reserve"))
    with OrchClient(h.address) as client:
        stream = client.generate(token_ids=list(PROMPT), request_id="z", max_tokens=3)
        chunks = []
        t = threading.Thread(target=lambda: chunks.extend(stream), daemon=True)
        t.start()
        h.run(entered.wait())
        h.call_in_loop(lambda: h.router.fleet.instance_failed("decode-0", "SIGSTOPped"))
        t.join(3)
        assert not t.is_alive()
    assert [tok for c in chunks for tok in c.token_ids] == expected_tokens(PROMPT, 3)
    assert chunks[-1].stats.decode_instance == "decode-1"
    h.call_in_loop(release.set)
    assert _wait_for(lambda: ("abort", "z@1") in _calls(h, "decode-0"))
    assert _all_released(h)

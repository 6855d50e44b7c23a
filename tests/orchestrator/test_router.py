"""Router end to end through a real grpc.aio server and the client, over fake leaders."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from orchestrator.api.client import OrchClient
from tests.orchestrator.fakes import EOS, expected_tokens
from tests.orchestrator.harness import TOKENIZER, Harness


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def _wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _calls(h, name):
    return h.call_in_loop(lambda: list(h.fakes[name].calls))


def _client_id(attempt_id: str) -> str:
    """The client's request id of an attempt id ("<request_id>@<n>") the workers saw."""
    return attempt_id.rsplit("@", 1)[0]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_streams_scripted_tokens_text_and_stats(mode):
    h = Harness(mode=mode)
    try:
        prompt = "Héllo wörld, 日本語 😀"
        ids = TOKENIZER.encode(prompt)
        with OrchClient(h.address) as client:
            chunks = list(client.generate(prompt, max_tokens=7, ignore_eos=True))
        want = expected_tokens(tuple(ids), 7)
        got = [t for c in chunks for t in c.token_ids]
        assert got == want
        assert "".join(c.text for c in chunks) == TOKENIZER.decode(want)
        assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        last = chunks[-1]
        assert last.finish_reason == "length"
        assert last.stats.prompt_tokens == len(ids) and last.stats.completion_tokens == 7
        assert 0 < last.stats.ttft_s <= last.stats.e2e_s and last.stats.tpot_s >= 0
        assert h.metrics.finished == [("length", len(ids), 7)]
        if mode == "disaggregated":
            assert last.stats.prefill_instance == "prefill-0"
            assert last.stats.decode_instance == "decode-0"
            rid = chunks[0].request_id + "@1"  # the first attempt's id: what workers see
            assert _calls(h, "decode-0") == [("reserve", rid), ("admit", rid, want[0])]
            assert _calls(h, "prefill-0") == [("prefill", rid, "decode-0")]
    finally:
        h.close()


def test_eos_finishes_with_stop(harness):
    # sum(prompt) + 7 i == EOS (1) at i = 2 -> three tokens, last is EOS
    prompt = (1 - 14,)
    prompt = ((1 - 14) % 129_280,)
    with OrchClient(harness.address) as client:
        text, ids, stats = client.generate_text(token_ids=list(prompt), max_tokens=10)
    assert ids == expected_tokens(prompt, 10, ignore_eos=False) and ids[-1] == EOS
    assert len(ids) == 3 and stats.completion_tokens == 3


def test_max_tokens_one_frees_the_decode_reservation(harness):
    with OrchClient(harness.address) as client:
        chunks = list(client.generate(token_ids=[5, 6, 7], max_tokens=1))
    assert [c.token_ids for c in chunks] == [tuple(expected_tokens((5, 6, 7), 1))]
    assert chunks[-1].finish_reason == "length"
    rid = chunks[0].request_id + "@1"
    assert _wait_for(lambda: ("abort", rid) in _calls(harness, "decode-0"))
    assert ("admit", rid, chunks[0].token_ids[0]) not in _calls(harness, "decode-0")
    assert harness.call_in_loop(lambda: dict(harness.fakes["decode-0"].reserved)) == {}


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=""), "prompt is empty"),
    (dict(token_ids=[]), "prompt is empty"),
    (dict(token_ids=[3, 129_280]), "token id 129280 is out of range [0, 129280)"),
    (dict(token_ids=[-1]), "token id -1 is out of range"),
    (dict(token_ids=[1] * 250, max_tokens=10),
     "prompt has 250 tokens + max_tokens 10 > max_model_len 256: shorten the prompt"),
])
def test_bad_input_is_invalid_argument(harness, kwargs, message):
    with OrchClient(harness.address) as client, pytest.raises(grpc.RpcError) as err:
        list(client.generate(**kwargs))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert _calls(harness, "decode-0") == []
    assert harness.metrics.rejected == ["INVALID_ARGUMENT"] and harness.metrics.finished == []


@pytest.mark.parametrize("field, value, message", [
    ("max_tokens", 0, "sampling.max_tokens is required"),
    ("max_tokens", -3, "max_tokens must be >= 1, got -3"),
    ("temperature", -1.0, "temperature must be a finite number >= 0"),
    ("top_k", -2, "top_k must be >= 0"),
    ("top_p", 1.5, "top_p must be in (0, 1]"),
])
def test_bad_sampling_is_invalid_argument(harness, field, value, message):
    from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
    req = orch_pb2.GenerateRequest(text="hi", sampling=orch_pb2.SamplingParams(max_tokens=4))
    setattr(req.sampling, field, value)
    with grpc.insecure_channel(harness.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(orch_pb2_grpc.OrchStub(channel).Generate(req))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_duplicate_request_id_is_invalid_argument(harness):
    harness.call_in_loop(lambda: setattr(harness.fakes["prefill-0"], "silent", True))
    with OrchClient(harness.address) as client:
        first = client.generate(token_ids=[4, 5], request_id="dup", max_tokens=3)
        started = threading.Thread(target=lambda: _drain(first), daemon=True)
        started.start()
        assert _wait_for(lambda: ("prefill", "dup@1", "decode-0") in _calls(harness, "prefill-0"))
        with pytest.raises(grpc.RpcError) as err:
            list(client.generate(token_ids=[4, 5], request_id="dup", max_tokens=3))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request id 'dup' is already in flight" in err.value.details()
        assert client.abort("dup") is True
        started.join(5)
    assert _wait_for(lambda: ("abort", "dup@1") in _calls(harness, "prefill-0"))


def _drain(it):
    try:
        for _ in it:
            pass
    except grpc.RpcError:
        pass


def test_sampled_request_gets_a_seed(harness):
    seen = []
    fake = harness.fakes["prefill-0"]
    original = fake.prefill
    harness.call_in_loop(lambda: setattr(fake, "prefill",
                                         lambda spec, res: (seen.append(spec), original(spec, res))[1]))
    with OrchClient(harness.address) as client:
        client.generate_text(token_ids=[9], max_tokens=2, temperature=0.8)
        client.generate_text(token_ids=[9], max_tokens=2, temperature=0.8, seed=42)
        client.generate_text(token_ids=[9], max_tokens=2)
    assert seen[0].sampling.seed is not None and seen[1].sampling.seed == 42
    assert seen[2].sampling.seed is None  # greedy stays unseeded


def test_queue_full_is_resource_exhausted():
    h = Harness(decode_capacity=1, max_pending=1, request_timeout_s=30.0)
    try:
        # NOTE: no fallback poll or deadline within the test: only the end of the holder may
        # wake the waiter.
        h.call_in_loop(lambda: setattr(h.router.flow.admission, "retry_s", 60.0))
        h.call_in_loop(lambda: setattr(h.fakes["prefill-0"], "silent", True))
        with OrchClient(h.address) as client:
            holders = [client.generate(token_ids=[i + 2], max_tokens=3) for i in range(2)]
            threads = [threading.Thread(target=_drain, args=(g,), daemon=True) for g in holders]
            threads[0].start()
            assert _wait_for(lambda: len(_calls(h, "decode-0")) == 1)  # holds the only slot
            threads[1].start()
            assert _wait_for(lambda: h.call_in_loop(lambda: h.router.flow.admission.waiting) == 1)
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(token_ids=[7], max_tokens=3))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "admission queue is full" in err.value.details()
            assert "router.max_pending=1" in err.value.details()
            assert h.metrics.rejected == ["RESOURCE_EXHAUSTED"]
            # the waiter is admitted as soon as the holder is aborted
            rid0 = _calls(h, "decode-0")[0][1]
            assert client.abort(_client_id(rid0))
            seen: list[set] = []

            def waiter_reserved() -> bool:  # NOTE: read once: the fake's dict moves on
                now = set(h.call_in_loop(lambda: dict(h.fakes["decode-0"].reserved)))
                seen.append(now)
                return len(now) == 1 and rid0 not in now
            assert _wait_for(waiter_reserved)
            (rid1,) = seen[-1]
            assert client.abort(_client_id(rid1))
            for t in threads:
                t.join(5)
                assert not t.is_alive()
    finally:
        h.close()


def test_admission_wait_is_bounded_by_request_timeout():
    h = Harness(decode_capacity=0, max_pending=4, request_timeout_s=0.5)
    try:
        with OrchClient(h.address) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate(token_ids=[3], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "router.request_timeout_s" in err.value.details()
    finally:
        h.close()


def test_request_that_never_fits_is_invalid_argument():
    h = Harness(never_fits=True)
    try:
        with OrchClient(h.address) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate(token_ids=[3], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "decode-0: needs 999 blocks" in err.value.details()
    finally:
        h.close()


def test_client_cancel_aborts_on_both_sides(harness):
    harness.call_in_loop(lambda: setattr(harness.fakes["prefill-0"], "silent", True))
    with grpc.insecure_channel(harness.address) as channel:
        from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
        call = orch_pb2_grpc.OrchStub(channel).Generate(orch_pb2.GenerateRequest(
            text="cancel me", request_id="c1", sampling=orch_pb2.SamplingParams(max_tokens=5)))
        assert _wait_for(lambda: ("prefill", "c1@1", "decode-0") in _calls(harness, "prefill-0"))
        call.cancel()
    assert _wait_for(lambda: ("abort", "c1@1") in _calls(harness, "decode-0"))
    assert ("abort", "c1@1") in _calls(harness, "prefill-0")
    assert harness.call_in_loop(lambda: dict(harness.fakes["decode-0"].reserved)) == {}
    assert _wait_for(lambda: harness.call_in_loop(lambda: harness.router.in_flight) == 0)
    assert harness.metrics.finished[-1][0] == "cancelled"


def test_failing_leader_stream_gives_unavailable_not_a_hang(harness):
    """The only prefill's event stream cannot be opened: each attempt fails at the next failed
    subscription (0.5 s apart), then UNAVAILABLE names every attempt's failure."""
    fake = harness.fakes["prefill-0"]
    harness.call_in_loop(lambda: setattr(fake, "poll_error", "rank 0 died"))
    assert _wait_for(lambda: fake.poll_failures > 0)  # no poll in flight can still answer
    start = time.monotonic()
    with OrchClient(harness.address) as client, pytest.raises(grpc.RpcError) as err:
        list(client.generate(token_ids=[3, 4], max_tokens=4, timeout_s=10))
    assert time.monotonic() - start < 4
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    details = err.value.details()
    assert "failed on 3 attempt(s) (router.max_attempts=3)" in details, details
    assert details.count("on prefill-0: prefill-0: opening its event stream failed: "
                         "prefill-0.open_events failed: RuntimeError: rank 0 died") == 3
    assert _wait_for(lambda: len([c for c in _calls(harness, "decode-0") if c[0] == "abort"]) == 3)
    assert harness.call_in_loop(lambda: dict(harness.fakes["decode-0"].reserved)) == {}


def test_worker_error_event_is_internal(harness):
    harness.call_in_loop(lambda: setattr(harness.fakes["decode-0"], "error_after_admit",
                                         "KV receive timed out"))
    with OrchClient(harness.address) as client:
        got = []
        with pytest.raises(grpc.RpcError) as err:
            for chunk in client.generate(token_ids=[3, 4], max_tokens=4):
                got.append(chunk)
    assert len(got) == 1 and len(got[0].token_ids) == 1  # the first token still came
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "decode-0: KV receive timed out" in err.value.details()


def test_silent_leader_is_deadline_exceeded():
    h = Harness(request_timeout_s=0.5)
    try:
        h.call_in_loop(lambda: setattr(h.fakes["prefill-0"], "silent", True))
        with OrchClient(h.address) as client, pytest.raises(grpc.RpcError) as err:
            list(client.generate(token_ids=[3], max_tokens=2))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "router.request_timeout_s=0.5" in err.value.details()
        assert _wait_for(lambda: ("abort", _calls(h, "decode-0")[0][1]) in _calls(h, "decode-0"))
    finally:
        h.close()


def test_status_and_health(harness):
    with OrchClient(harness.address) as client:
        client.wait_ready(5)
        instances, in_flight, model = client.status()
    assert [(i.name, i.role, i.health, i.status.ranks) for i in instances] == [
        ("prefill-0", "prefill", "healthy", ((0, "node-a", "cpu", 4242),)),
        ("decode-0", "decode", "healthy", ((0, "node-a", "cpu", 4242),))]
    assert in_flight == 0 and model == "fake"
    assert harness.metrics.instances[-1] == [i.status for i in instances]


def test_least_outstanding_tokens_spreads_over_decode_instances():
    import asyncio

    from orchestrator.deploy.assemble import build_router
    from orchestrator.config.schema import OrchConfig
    from orchestrator.router.request import GenerateInput
    from engine.sampling_params import SamplingParams
    from tests.orchestrator.fakes import FakeDecode, FakePrefill, Remote
    from tests.orchestrator.harness import MODEL

    async def scenario():
        cfg = OrchConfig.model_validate({
            "cluster": {"device": "cpu"}, "model": {"max_model_len": 256},
            "prefill": {"num_kv_blocks": 16}, "decode": {"dp": 2, "num_kv_blocks": 16},
            "router": {"policy": "least_outstanding_tokens", "request_timeout_s": 2}})
        fakes = {"prefill-0": FakePrefill(), "decode-0": FakeDecode("decode-0"),
                 "decode-1": FakeDecode("decode-1")}
        fakes["prefill-0"].silent = True  # requests stay in flight
        router = build_router(cfg, {n: Remote(f) for n, f in fakes.items()}, MODEL, None)
        router.start()
        gens = [router.generate(GenerateInput(None, (5,) * n, SamplingParams(max_tokens=4)))
                for n in (50, 10, 10)]
        tasks = [asyncio.create_task(g.__anext__()) for g in gens]
        await asyncio.sleep(0.3)
        placed = {rid: name for name in ("decode-0", "decode-1")
                  for _, rid in fakes[name].calls}
        load = dict(router.flow.policy.outstanding)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()
        await asyncio.sleep(0.1)
        after = dict(router.flow.policy.outstanding)
        await router.stop(drain_timeout_s=1)
        return placed, load, after, fakes

    placed, load, after, fakes = asyncio.run(scenario())
    # 54 tokens on decode-0 first; then 14 on decode-1; then decode-1 (14) < decode-0 (54)
    assert sorted(placed.values()) == ["decode-0", "decode-1", "decode-1"]
    assert load == {"decode-0": 54, "decode-1": 28}
    assert after == {"decode-0": 0, "decode-1": 0}  # every load released exactly once
    assert all(f.reserved == {} for n, f in fakes.items() if n.startswith("decode"))


def test_graceful_stop_drains_in_flight_and_refuses_new():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    h = Harness()
    try:
        h.call_in_loop(lambda: setattr(h.fakes["prefill-0"], "silent", True))
        with OrchClient(h.address) as client:
            stream = client.generate(token_ids=[8, 9], request_id="slow", max_tokens=3)
            result = {}
            t = threading.Thread(target=lambda: result.update(
                chunks=list(stream)), daemon=True)
            t.start()
            assert _wait_for(lambda: ("prefill", "slow@1", "decode-0") in _calls(h, "prefill-0"))
            import asyncio
            stopping = asyncio.run_coroutine_threadsafe(h.server.stop(grace_s=5.0), h.loop)
            assert _wait_for(lambda: not h.router._accepting)
            health = health_pb2_grpc.HealthStub(client.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(client.generate(token_ids=[1, 2], max_tokens=2))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in err.value.details()
            # the in-flight request still finishes during the drain
            def finish():
                fake = h.fakes["prefill-0"]
                fake.silent = False
                fake.emit("slow@1", [expected_tokens((8, 9), 1)[0]], source="prefill")
            h.call_in_loop(finish)
            t.join(5)
            stopping.result(10)
        assert [c for c in result["chunks"] if c.finish_reason][0].finish_reason == "length"
        assert [t for c in result["chunks"] for t in c.token_ids] == expected_tokens((8, 9), 3)
    finally:
        h.loop.call_soon_threadsafe(h.loop.stop)
        h.thread.join(5)


def test_router_side_stop_aborts_the_worker_request():
    h = Harness(mode="colocated")
    try:
        h.call_in_loop(lambda: setattr(h.fakes["colocated-0"], "report_finish", False))
        with OrchClient(h.address) as client:
            chunks = list(client.generate(token_ids=[3, 4], max_tokens=3))
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((3, 4), 3)
        assert chunks[-1].finish_reason == "length"
        rid = chunks[0].request_id + "@1"
        assert _wait_for(lambda: ("abort", rid) in _calls(h, "colocated-0"))
    finally:
        h.close()


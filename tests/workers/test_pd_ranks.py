"""Prefill and decode rank actors in one process (TP=1 each, no Ray), driven as the router
drives them: reserve -> prefill -> first token -> admit -> decode. Outputs equal a solo greedy
run; every block on both sides is freed exactly once; abort paths leave nothing behind."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from kv_transfer.config import TransferConfig
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Abort, Admit, Prefill, Rejection, Reservation, Reserve
from engine.request import RequestSpec
from prefill_worker.role import PrefillRole
from rank.rank import Rank
from tests.engine.engine_drive import generate_greedy
from tests.leaks import wait_ranks_idle


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


def start(role_cls, ckpt, role, **kw):
    scheduler = SchedulerConfig(block_size=kw.pop("block_size", 4),
                                num_kv_blocks=kw.pop("blocks", 64), chunk_size=8,
                                max_num_batched_tokens=16, max_num_seqs=4)
    transfer = TransferConfig(connect_timeout_s=10, header_timeout_s=10, payload_timeout_s=10,
                              completion_timeout_s=kw.pop("completion_timeout_s", 20))
    cfg = InstanceConfig(name=f"{role}-0", role=role, checkpoint_dir=str(ckpt),
                         scheduler=scheduler, transfer=transfer)
    rank = Rank(cfg, 0, role_cls)
    rank.start_alone()
    return rank


@pytest.fixture
def pd(ckpt):
    prefill = start(PrefillRole, ckpt, "prefill")
    decode = start(DecodeRole, ckpt, "decode", block_size=8)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def wait_events(rank, rid, until, timeout_s=30.0):
    """Events of ``rid`` until ``until(event)``; bounded."""
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in rank.poll(0.1):
            if ev.request_id == rid:
                got.append(ev)
                if until(ev):
                    return got
    raise AssertionError(f"{rid}: no final event within {timeout_s} s; got {got}")


def run_pd(prefill, decode, spec):
    res = decode.request(Reserve(spec, 1))
    assert isinstance(res, Reservation), res
    prefill.request(Prefill(spec, res))
    (first,) = wait_events(prefill, spec.request_id, lambda e: True)
    assert first.source == "prefill" and first.error is None, first
    tokens = list(first.token_ids)
    if first.finish_reason is not None:
        decode.request(Abort(spec.request_id))
        return tokens, first.finish_reason
    decode.request(Admit(spec.request_id, tokens[0]))
    events = wait_events(decode, spec.request_id, lambda e: e.finish_reason is not None)
    assert events[-1].error is None, events[-1]
    return tokens + [t for e in events for t in e.token_ids], events[-1].finish_reason


def wait_all_free(*ranks, timeout_s=10.0):
    """Every rank's blocks free and no request active (tests.leaks.wait_ranks_idle)."""
    wait_ranks_idle(*ranks, timeout_s=timeout_s)


def test_pd_matches_solo_greedy_and_frees_everything(pd, ckpt):
    prefill, decode = pd
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    for i, (n, m) in enumerate([(3, 5), (21, 6), (1, 4)]):
        prompt = tuple(range(2000 + i, 2000 + i + n))
        expected, _ = generate_greedy(solo, list(prompt), m, tuple(range(4)))
        spec = RequestSpec(f"r{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True))
        assert run_pd(prefill, decode, spec) == (expected, "length")
    wait_all_free(prefill, decode)
    status = prefill.status()
    spec_ = prefill.runner.kv_spec
    prompt_tokens = 3 + 21 + 1
    expected = prompt_tokens * spec_.num_layers * spec_.bytes_per_token_per_layer
    assert status.kv_bytes_sent == expected
    assert [(r.pair, r.nbytes, r.ok) for r in status.transfers] == [
        ("prefill-0:0->decode-0:0", n * spec_.num_layers * spec_.bytes_per_token_per_layer, True)
        for n in (3, 21, 1)]
    assert prefill.status().transfers == ()  # each record is reported once
    assert prefill.leader.pool.num_live_sets == 0 and decode.leader.pool.num_live_sets == 0


def test_one_token_request_and_too_big_reservation(pd):
    prefill, decode = pd
    spec = RequestSpec("one", (5, 6, 7), SamplingParams(max_tokens=1))
    tokens, reason = run_pd(prefill, decode, spec)
    assert len(tokens) == 1 and reason == "length"
    big = decode.request(Reserve(RequestSpec("big", tuple(range(600)),
                                             SamplingParams(max_tokens=8)), 1))
    assert isinstance(big, Rejection) and not big.retryable and "num_kv_blocks" in big.reason
    wait_all_free(prefill, decode)


def test_abort_mid_flight_frees_both_sides(pd):
    """Abort after the first of four prefill chunks ran (its KV sent or in flight to decode)."""
    prefill, decode = pd
    first_chunk_ran, resume = threading.Event(), threading.Event()
    step = prefill.role.step

    def step_then_hold() -> bool:
        busy = step()
        if busy and not first_chunk_ran.is_set():
            first_chunk_ran.set()
            resume.wait(10)
        return busy

    prefill.role.step = step_then_hold  # the loop looks up role.step on every iteration
    spec = RequestSpec("ab", tuple(range(3000, 3030)),
                       SamplingParams(max_tokens=40, ignore_eos=True))
    res = decode.request(Reserve(spec, 1))
    prefill.request(Prefill(spec, res))
    try:
        assert first_chunk_ran.wait(10)
        assert prefill.leader.scheduler.find("ab").num_computed_tokens == 8  # chunk_size 8 of 30
        assert prefill.request(Abort("ab")) is True
    finally:
        resume.set()
    assert prefill.leader.scheduler.find("ab") is None
    assert decode.request(Abort("ab"))
    wait_all_free(prefill, decode)
    assert not any(e.token_ids for e in prefill.poll(0.2) if e.request_id == "ab")


def test_never_admitted_kv_fails_after_completion_timeout(ckpt):
    decode = start(DecodeRole, ckpt, "decode", completion_timeout_s=0.5)
    try:
        spec = RequestSpec("lost", (1, 2, 3), SamplingParams(max_tokens=4))
        assert isinstance(decode.request(Reserve(spec, 1)), Reservation)
        decode.request(Admit("lost", 9))  # prefill never sends: KV must not be waited on forever
        (ev,) = wait_events(decode, "lost", lambda e: e.finish_reason is not None, 10)
        assert ev.finish_reason == "error" and "within 0.5 s of the first token" in ev.error
        wait_all_free(decode)
    finally:
        decode.shutdown()


def test_reservation_may_wait_in_the_prefill_queue_longer_than_completion_timeout(ckpt):
    """The completion bound runs from the first token, not from the reservation."""
    prefill = start(PrefillRole, ckpt, "prefill", completion_timeout_s=0.5)
    decode = start(DecodeRole, ckpt, "decode", completion_timeout_s=0.5)
    try:
        spec = RequestSpec("queued", tuple(range(7)), SamplingParams(max_tokens=3))
        res = decode.request(Reserve(spec, 1))
        time.sleep(1.0)  # stands for a prefill queue ahead of it
        prefill.request(Prefill(spec, res))
        (first,) = wait_events(prefill, "queued", lambda e: True)
        decode.request(Admit("queued", first.token_ids[0]))
        events = wait_events(decode, "queued", lambda e: e.finish_reason is not None)
        assert events[-1].finish_reason == "length", events[-1]
        wait_all_free(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_abort_that_arrives_before_the_request_wins(pd):
    """Actor calls of one request run on several threads: an abort may overtake its reserve
    or its prefill. The late call must not start anything (no leaked blocks)."""
    prefill, decode = pd
    spec = RequestSpec("early", (4, 5, 6), SamplingParams(max_tokens=3))
    assert decode.request(Abort("early")) is False
    late = decode.request(Reserve(spec, 1))
    assert isinstance(late, Rejection) and not late.retryable and "aborted" in late.reason
    other = RequestSpec("early2", (4, 5, 6), SamplingParams(max_tokens=3))
    res = decode.request(Reserve(other, 1))
    assert prefill.request(Abort("early2")) is False
    prefill.request(Prefill(other, res))
    (ev,) = wait_events(prefill, "early2", lambda e: True)
    assert ev.finish_reason == "abort" and not ev.token_ids
    assert decode.request(Abort("early2"))
    wait_all_free(prefill, decode)

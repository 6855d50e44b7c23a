"""Eager PD launch on real ranks in one process (TP=1, no Ray): the prompt is computed before
decode's reservation exists (``Prefill(spec, None)``), the reservation comes with ``Attach``;
outputs equal a solo greedy run and every block is freed exactly once on both sides, on the
way through, on an abort before the reservation and when no reservation ever comes."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.messages import Abort, Admit, Attach, Prefill, Reservation, Reserve
from tests.engine.engine_drive import generate_greedy
from tests.workers.test_pd_ranks import start, wait_all_free, wait_events


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture
def pd(ckpt):
    prefill = start(PrefillRole, ckpt, "prefill")
    decode = start(DecodeRole, ckpt, "decode", block_size=8)
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def decode_rest(decode, spec, first):
    decode.request(Admit(spec.request_id, first))
    events = wait_events(decode, spec.request_id, lambda e: e.finish_reason is not None)
    assert events[-1].error is None, events[-1]
    return [first] + [t for e in events for t in e.token_ids]


def test_attach_after_the_first_token_ships_the_whole_prompt(pd, ckpt):
    """The prompt (1 and 3 chunks of 8) computes and samples before the reservation exists;
    Attach ships all of it at once, the decode continues to the same tokens as solo."""
    prefill, decode = pd
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    sent = 0
    for i, (n, m) in enumerate([(5, 4), (21, 6)]):
        prompt = tuple(range(2100 + i, 2100 + i + n))
        expected, _ = generate_greedy(solo, list(prompt), m, tuple(range(4)))
        spec = RequestSpec(f"e{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True))
        prefill.request(Prefill(spec, None))
        (first,) = wait_events(prefill, spec.request_id, lambda e: True)
        assert first.token_ids == (expected[0],) and first.error is None
        assert prefill.status().kv_bytes_sent == sent  # nothing shipped without a reservation
        res = decode.request(Reserve(spec, 1))
        assert isinstance(res, Reservation)
        assert prefill.request(Attach(spec.request_id, res)) is True
        assert decode_rest(decode, spec, first.token_ids[0]) == expected
        spec_ = prefill.runner.kv_spec
        sent += n * spec_.num_layers * spec_.bytes_per_token_per_layer
    wait_all_free(prefill, decode)
    assert prefill.status().kv_bytes_sent == sent
    assert prefill.leader.pool.num_live_sets == 0 and decode.leader.pool.num_live_sets == 0


def test_attach_between_chunks_ships_the_rest_as_computed(pd, ckpt):
    """Attach after the first of four chunks: that chunk ships late, the others per step."""
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
    prompt = tuple(range(3100, 3130))
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    expected, _ = generate_greedy(solo, list(prompt), 5, tuple(range(4)))
    spec = RequestSpec("mid", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    prefill.request(Prefill(spec, None))
    try:
        assert first_chunk_ran.wait(10)
        assert prefill.leader.scheduler.find("mid").num_computed_tokens == 8
        assert prefill.request(Attach("mid", decode.request(Reserve(spec, 1)))) is True
    finally:
        resume.set()
    (first,) = wait_events(prefill, "mid", lambda e: True)
    assert decode_rest(decode, spec, first.token_ids[0]) == expected
    wait_all_free(prefill, decode)


def test_abort_before_the_reservation_frees_once_and_attach_says_gone(pd):
    prefill, decode = pd
    spec = RequestSpec("ab", tuple(range(40, 52)), SamplingParams(max_tokens=4))
    prefill.request(Prefill(spec, None))
    wait_events(prefill, "ab", lambda e: True)
    assert prefill.leader.pool.num_live_sets == 1  # its blocks wait for the reservation
    assert prefill.request(Abort("ab")) is True
    res = decode.request(Reserve(spec, 1))
    assert prefill.request(Attach("ab", res)) is False
    assert decode.request(Abort("ab"))
    wait_all_free(prefill, decode)


def test_a_reservation_that_never_comes_ends_the_request(ckpt):
    """Its router gone: the computed prompt's blocks are freed after 4 completion timeouts,
    with an error event."""
    prefill = start(PrefillRole, ckpt, "prefill", completion_timeout_s=0.25)
    try:
        spec = RequestSpec("orphan", (7, 8, 9), SamplingParams(max_tokens=4))
        prefill.request(Prefill(spec, None))
        events = wait_events(prefill, "orphan", lambda e: e.finish_reason is not None, 10)
        assert events[0].token_ids and events[-1].finish_reason == "error"
        assert "no decode reservation" in events[-1].error
        wait_all_free(prefill)
    finally:
        prefill.shutdown()


def test_attach_to_an_admitted_prompt_with_a_cached_prefix_ships_it_once(pd, ckpt):
    """A prompt admitted (its blocks taken, 16 tokens found in this instance's prefix cache)
    that got no budget in its first step: its Attach ships nothing yet, its first chunk ships
    the cached prefix with it, once (the bytes sent count every prompt token once), and the
    tokens equal a solo greedy run."""
    prefill, decode = pd
    warm = RequestSpec("warm", tuple(range(500, 517)), SamplingParams(max_tokens=2))
    prefill.request(Prefill(warm, None))  # NOTE: computed, then dropped: its 16 stay cached
    wait_events(prefill, "warm", lambda e: True)
    assert prefill.request(Abort("warm")) is True
    wait_all_free(prefill)
    sent = prefill.status().kv_bytes_sent
    go, first_step_ran, resume = threading.Event(), threading.Event(), threading.Event()
    step = prefill.role.step

    def gated_step() -> bool:
        go.wait(10)
        busy = step()
        if busy and not first_step_ran.is_set():
            first_step_ran.set()
            resume.wait(10)
        return busy

    prefill.role.step = gated_step
    prompts = {"a": tuple(range(600, 630)), "b": tuple(range(700, 730)),
               "c": tuple(range(500, 516)) + tuple(range(800, 805))}
    specs = {rid: RequestSpec(rid, p, SamplingParams(max_tokens=4, ignore_eos=True))
             for rid, p in prompts.items()}
    try:
        for spec in specs.values():
            prefill.request(Prefill(spec, None))
        go.set()
        assert first_step_ran.wait(10)  # a and b took the step's 16 tokens; c got none
        c = prefill.leader.scheduler.find("c")
        assert c.blocks is not None and c.num_computed_tokens == c.num_cached_tokens == 16
        for rid, spec in specs.items():
            res = decode.request(Reserve(spec, 1))
            assert isinstance(res, Reservation) and res.num_cached_tokens == 0
            assert prefill.request(Attach(rid, res)) is True
    finally:
        go.set()
        resume.set()
    firsts, deadline = {}, time.monotonic() + 30
    while len(firsts) < len(specs) and time.monotonic() < deadline:
        firsts.update((e.request_id, e) for e in prefill.poll(0.1) if e.request_id in specs)
    assert set(firsts) == set(specs), firsts
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    for rid, spec in specs.items():
        expected, _ = generate_greedy(solo, list(spec.prompt_token_ids), 4, tuple(range(4)))
        assert firsts[rid].error is None, firsts[rid]
        assert decode_rest(decode, spec, firsts[rid].token_ids[0]) == expected, rid
    wait_all_free(prefill, decode)
    kv = prefill.runner.kv_spec
    tokens = sum(len(p) for p in prompts.values())
    assert prefill.status().kv_bytes_sent - sent == \
        tokens * kv.num_layers * kv.bytes_per_token_per_layer

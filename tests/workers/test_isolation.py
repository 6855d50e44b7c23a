"""A request can only ever fail itself (issue 9, fault 1): bad sampling numbers, a poisoned
logits row or a model step that raises while one request is in the batch fail that request
alone; its batch mates get the tokens a clean run gives them, and every block comes back.

Real ranks in-process (TP=1, no Ray); faults are injected at the model runner."""

from __future__ import annotations

import time

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.colocated import ColocatedRole
from rank.messages import Abort, Admit, Generate, Prefill, Reservation, Reserve
from engine.request import RequestSpec
from tests.engine.engine_drive import generate_greedy
from tests.workers.test_pd_ranks import start, wait_all_free

PROMPTS = {"a": tuple(range(1000, 1005)), "b": tuple(range(1100, 1109)),
           "c": tuple(range(1200, 1206)), "d": tuple(range(1300, 1307))}
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=7)


@pytest.fixture(scope="module")
def expected(ckpt):
    """request id -> its greedy tokens when it runs alone."""
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    return {rid: generate_greedy(solo, list(p), MAX_TOKENS, tuple(range(4)))[0]
            for rid, p in PROMPTS.items()}


def spec(rid: str, **sampling) -> RequestSpec:
    return RequestSpec(rid, PROMPTS[rid], SamplingParams(max_tokens=MAX_TOKENS,
                                                         ignore_eos=True, **sampling))


def inject(rank, culprit: str, fault: str) -> None:
    """Make ``rank``'s model step fail whenever ``culprit`` is in the batch: ``raise`` raises,
    ``nan`` poisons its logits row."""
    clean = rank.runner.execute

    def execute(steps, *hook):  # hook: the prefill's per-layer KV sends (layer by layer)
        ids = [s.request_id for s in steps]
        if culprit not in ids:
            return clean(steps, *hook)
        if fault == "raise":
            raise RuntimeError(f"injected fault: {culprit} is in the batch")
        logits = clean(steps, *hook).clone()  # an inference tensor: not writable in place
        logits[ids.index(culprit)] = float("nan")
        return logits

    rank.runner.execute = execute


def collect(rank, ids, first_only=False, timeout_s=30.0):
    """request id -> (tokens, finish reason, error) once each ended (``first_only``: after its
    first event, prefill's hand-off)."""
    out = {rid: ([], None, None) for rid in ids}
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while any((rid not in seen) if first_only else (out[rid][1] is None) for rid in ids):
        assert time.monotonic() < deadline, f"no end within {timeout_s} s: {out}"
        for ev in rank.poll(0.1):
            if ev.request_id in out:
                toks = out[ev.request_id][0] + list(ev.token_ids)
                out[ev.request_id] = (toks, ev.finish_reason, ev.error)
                seen.add(ev.request_id)
    return out


@pytest.fixture
def colocated(ckpt):
    rank = start(ColocatedRole, ckpt, "colocated")
    yield rank
    rank.shutdown()


def test_tiny_temperature_is_greedy_in_a_busy_batch(colocated, expected):
    """temperature 1e-38 once turned the step's probabilities into NaN and failed its batch."""
    for rid in PROMPTS:
        sampling = {"temperature": 1e-38, "seed": 3} if rid == "b" else {}
        colocated.request(Generate(spec(rid, **sampling)))
    got = collect(colocated, list(PROMPTS))
    assert got == {rid: (expected[rid], "length", None) for rid in PROMPTS}
    wait_all_free(colocated)


@pytest.mark.parametrize("fault, reason", [("nan", "non-finite logits"),
                                           ("raise", "injected fault: c is in the batch")])
def test_a_failing_request_fails_alone(colocated, expected, fault, reason):
    inject(colocated, "c", fault)
    for rid in PROMPTS:
        colocated.request(Generate(spec(rid)))
    got = collect(colocated, list(PROMPTS))
    toks, finish, error = got.pop("c")
    assert finish == "error" and reason in error and "colocated-0" in error, error
    assert got == {rid: (expected[rid], "length", None) for rid in got}
    wait_all_free(colocated)
    colocated.request(Generate(spec("a")))  # the loop lives on
    assert collect(colocated, ["a"])["a"] == (expected["a"], "length", None)


def test_pd_prefill_and_decode_faults_fail_only_their_request(ckpt, expected):
    """Prefill re-runs the chunks of a failed step alone (their KV may go out twice: decode
    counts it once); decode does the same with its batch."""
    prefill = start(PrefillRole, ckpt, "prefill")
    decode = start(DecodeRole, ckpt, "decode", block_size=8)
    try:
        inject(prefill, "b", "raise")
        inject(decode, "d", "raise")
        for rid in PROMPTS:
            res = decode.request(Reserve(spec(rid), 1))
            assert isinstance(res, Reservation), res
            prefill.request(Prefill(spec(rid), res))
        first = collect(prefill, list(PROMPTS), first_only=True)
        assert first["b"][1] == "error" and "injected fault: b" in first["b"][2], first["b"]
        assert decode.request(Abort("b"))  # what the router does when prefill fails a request
        for rid in ("a", "c", "d"):
            assert first[rid][2] is None, first[rid]
            decode.request(Admit(rid, first[rid][0][0]))
        rest = collect(decode, ["a", "c", "d"])
        assert rest["d"][1] == "error" and "injected fault: d" in rest["d"][2], rest["d"]
        for rid in ("a", "c"):
            assert first[rid][0] + rest[rid][0] == expected[rid] and rest[rid][1] == "length"
        wait_all_free(prefill, decode)
        assert prefill.leader.pool.num_live_sets == 0 and decode.leader.pool.num_live_sets == 0
    finally:
        prefill.shutdown()
        decode.shutdown()

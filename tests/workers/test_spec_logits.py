"""Logits processing under MTP speculative decoding, through a colocated rank in-process (TP 1,
no Ray): greedy requests with penalties, min_tokens, a grammar (JSON schema, regex) or logprobs
give the same tokens and logprobs with MTP as without, with an oracle's drafts (the plain
output, wrong where position % 3 == 0; the MTP module still runs) so that drafts are kept and
rejected and the grammar refuses some: each verified row is processed as plain decoding
processes it (row by row: tests/engine/test_spec_logits_stage.py)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from engine.request import RequestSpec
from engine.sampling_params import GrammarSpec, SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.messages import Generate
from tests.engine.spec_drive import oracle_drafts_of
from tests.workers.test_spec_colocated import make_rank
from tests.workers.test_structured_output import REGEX, SCHEMAS

PROMPT = tuple(range(1000, 1017))
PENALTIES = {"repetition_penalty": 1.5, "frequency_penalty": 0.7, "presence_penalty": 0.4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mtp_lp"), seed=3, mtp_layers=1)


def _specs(stop: int) -> list[RequestSpec]:
    json_grammar = GrammarSpec("json_schema", json.dumps(SCHEMAS["enum"]))
    params = {
        "pen": SamplingParams(max_tokens=12, ignore_eos=True, **PENALTIES),
        # NOTE: ``stop`` is what plain greedy emits third: banned until 6 tokens exist
        "min": SamplingParams(max_tokens=10, min_tokens=6, stop_token_ids=(stop,)),
        "json": SamplingParams(max_tokens=24, grammar=json_grammar),
        "regex": SamplingParams(max_tokens=12, grammar=GrammarSpec("regex", REGEX)),
        "lp": SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3),
        "mix": SamplingParams(max_tokens=24, grammar=json_grammar, logprobs=2, **PENALTIES),
    }
    return [RequestSpec(rid, PROMPT, p) for rid, p in params.items()]


def run_all(rank, specs, timeout_s=60.0):
    """request id -> ([(token, its TokenLogprobs or None)], finish reason, error)."""
    for spec in specs:
        rank.request(Generate(spec))
    out = {s.request_id: ([], None, None) for s in specs}
    deadline = time.monotonic() + timeout_s
    while any(v[1] is None for v in out.values()):
        assert time.monotonic() < deadline, f"not finished: {out}"
        for ev in rank.poll(0.2):
            lps = ev.logprobs or (None,) * len(ev.token_ids)
            toks = out[ev.request_id][0] + list(zip(ev.token_ids, lps, strict=True))
            out[ev.request_id] = (toks, ev.finish_reason, ev.error)
    return out


@pytest.fixture(scope="module")
def plain(ckpt):
    """(request specs, request id -> (tokens with logprobs, finish, error)) without MTP."""
    rank = make_rank(ckpt, 0)
    try:
        probe = RequestSpec("probe", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
        stop = run_all(rank, [probe])["probe"][0][2][0]
        specs = _specs(stop)
        ref = run_all(rank, specs)
        assert ref["min"][0][2][0] != stop  # min_tokens mattered
        return specs, ref
    finally:
        rank.shutdown()


def _same(got, want) -> None:
    (toks, finish, error), (ref, ref_finish, ref_error) = got, want
    assert (finish, error) == (ref_finish, ref_error) and error is None
    assert [t for t, _ in toks] == [t for t, _ in ref]
    for (_, a), (_, b) in zip(toks, ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_processed_greedy_with_mtp_equals_without(ckpt, plain, monkeypatch):
    specs, ref = plain
    oracle_drafts_of(monkeypatch, {s.request_id: [*s.prompt_token_ids, *(t for t, _ in ref[
        s.request_id][0])] + [0] * 4 for s in specs})
    rank = make_rank(ckpt, 2)
    try:
        got = run_all(rank, specs)
        for s in specs:
            _same(got[s.request_id], ref[s.request_id])
        stats = rank.leader._step.spec_stats
        assert 0 < stats.accepted < stats.drafted
    finally:
        rank.shutdown()

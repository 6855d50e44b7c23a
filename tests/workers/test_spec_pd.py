"""MTP speculative decoding through prefill/decode disaggregation, in-process (TP=1, no Ray):
prefill runs the MTP module over the prompt and ships its KV as one more layer, and the last
prompt position's hidden state with its done records; decode's first step drafts from it
and verifies (it computes position P, not P - 1 again); decode's greedy output with drafts
equals a solo greedy run without them, also when no hidden state comes (the fallback: the
first step recomputes P - 1); a prefill with MTP and a decode without it are refused by the
layout fingerprint with a message naming the setting."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Admit, Prefill, Reservation, Reserve
from rank.leader_step import verify_step
from rank.rank import Rank
from tests.engine.engine_drive import generate_greedy
from tests.workers.test_pd_ranks import run_pd, wait_all_free, wait_events
from tests.workers.test_spec_colocated import make_rank, oracle_drafts, run_all

PROMPTS = [list(range(3000 + i, 3000 + i + n)) for i, n in enumerate((3, 21, 1))]
MAX_TOKENS = [7, 9, 5]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mtp_pd"), seed=6, mtp_layers=1)


@pytest.fixture(scope="module")
def expected(ckpt):
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    return [generate_greedy(solo, p, m, tuple(range(4)))[0] for p, m in zip(PROMPTS, MAX_TOKENS)]


def start(ckpt, role_cls, role: str, k: int, block_size: int) -> Rank:
    scheduler = SchedulerConfig(block_size=block_size, num_kv_blocks=64,
                                chunk_size=8 if role == "prefill" else 1 + k,
                                max_num_batched_tokens=16, max_num_seqs=4,
                                num_speculative_tokens=k)
    transfer = TransferConfig(connect_timeout_s=10, header_timeout_s=10, payload_timeout_s=10,
                              completion_timeout_s=10)
    cfg = InstanceConfig(name=f"{role}-0", role=role, checkpoint_dir=str(ckpt),
                         scheduler=scheduler, transfer=transfer)
    rank = Rank(cfg, 0, role_cls)
    rank.start_alone()
    return rank


Seen = dict[tuple[str, str], list[tuple[int, tuple[int, ...]]]]


def verify_steps(monkeypatch) -> Seen:
    """(instance, request id) -> (first position, drafts) of each of its verify steps."""
    seen: Seen = defaultdict(list)

    def spy(name, out, spec, *args):
        for i, chunk in enumerate(out.chunks):
            if chunk.completes:
                seen[name, chunk.request.request_id].append((chunk.start, spec.drafts[i]))
        return verify_step(name, out, spec, *args)

    monkeypatch.setattr("rank.leader_step.verify_step", spy)
    return seen


@pytest.mark.parametrize("shipped", [True, False])
def test_pd_spec_greedy_matches_solo_with_oracle_drafts(ckpt, expected, monkeypatch, shipped):
    monkeypatch.setattr("tests.workers.test_spec_colocated.PROMPTS", PROMPTS)
    oracle_drafts(monkeypatch, expected)
    if not shipped:  # a prefill that sends no hidden state: decode recomputes P - 1
        monkeypatch.setattr("prefill_worker.kv_sends.draft_hidden", lambda output, row: b"")
    seen = verify_steps(monkeypatch)
    prefill = start(ckpt, PrefillRole, "prefill", 2, 4)
    decode = start(ckpt, DecodeRole, "decode", 2, 8)
    try:
        assert prefill.runner.kv_spec.mtp_layers == 1
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            spec = RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=m, ignore_eos=True))
            assert run_pd(prefill, decode, spec) == (expected[i], "length")
        wait_all_free(prefill, decode)
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            first, drafts = seen["decode-0", f"r{i}"][0]
            # NOTE: the first step verifies min(k, m - 2) drafts (never past max_tokens)
            assert (first, len(drafts)) == ((len(p), min(2, m - 2)) if shipped
                                            else (len(p) - 1, 0))
        stats = decode.leader._step.spec_stats
        assert 0 < stats.accepted < stats.drafted
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_pd_first_drafts_equal_colocated_and_output_equals_solo(ckpt, expected, monkeypatch):
    """Decode's first step drafts from the shipped hidden state exactly what a colocated
    instance drafts at the same position (its step after the prompt), and keeps greedy's
    tokens."""
    seen = verify_steps(monkeypatch)
    prefill = start(ckpt, PrefillRole, "prefill", 2, 4)
    decode = start(ckpt, DecodeRole, "decode", 2, 8)
    try:
        for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            spec = RequestSpec(f"r{i}", tuple(p), SamplingParams(max_tokens=m, ignore_eos=True))
            assert run_pd(prefill, decode, spec) == (expected[i], "length")
        wait_all_free(prefill, decode)
        assert decode.leader._step.spec_stats.drafted > 0
    finally:
        prefill.shutdown()
        decode.shutdown()
    monkeypatch.setattr("tests.workers.test_spec_colocated.PROMPTS", PROMPTS)
    monkeypatch.setattr("tests.workers.test_spec_colocated.MAX_TOKENS", MAX_TOKENS)
    colocated = make_rank(ckpt, 2)
    try:
        got = run_all(colocated)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == \
            [(e, "length", None) for e in expected]
    finally:
        colocated.shutdown()
    for i, p in enumerate(PROMPTS):
        pd_first = seen["decode-0", f"r{i}"][0]
        assert pd_first[0] == len(p) and len(pd_first[1]) == 2
        assert dict(seen["colocated-0", f"r{i}"])[len(p)] == pd_first[1]


def test_prefill_with_mtp_and_decode_without_is_refused(ckpt):
    prefill = start(ckpt, PrefillRole, "prefill", 1, 4)
    decode = start(ckpt, DecodeRole, "decode", 0, 8)
    try:
        spec = RequestSpec("x", tuple(range(5)), SamplingParams(max_tokens=3, ignore_eos=True))
        res = decode.request(Reserve(spec, 1))
        assert isinstance(res, Reservation), res
        prefill.request(Prefill(spec, res))
        (first,) = wait_events(prefill, "x", lambda e: True)
        decode.request(Admit("x", first.token_ids[0]))
        events = wait_events(decode, "x", lambda e: e.finish_reason is not None, timeout_s=30)
        assert "mtp_layers" in events[-1].error and "decode.speculative" in events[-1].error
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_pd_v32_ships_the_mtp_layers_index_k(tmp_path):
    """DeepSeek-V3.2 (index_topk 32 < the 40-token prompt): the MTP layer's own index_k ships
    with its K and V, so decode's first drafts equal a solo runner's at the same position and
    the output equals plain greedy."""
    from engine.runner import SeqStep  # noqa: PLC0415 (this test only)
    from engine.spec_decode import DraftInput  # noqa: PLC0415

    v32 = write_tiny_checkpoint(tmp_path / "v32", seed=2, deepseek_v32=True, mtp_layers=1)
    prompt, table = list(range(4000, 4040)), tuple(range(8))
    solo = ModelRunner(v32, num_kv_blocks=8, block_size=8, num_speculative_tokens=2)
    out = solo.execute([SeqStep("s", tuple(prompt), 0, table)])
    t0 = int(out.logits[-1].argmax())
    first = solo.execute([SeqStep("s", (t0,), len(prompt), table, num_drafts=2,
                                  draft=DraftInput(out.hidden[0][-1:], len(prompt) - 1, (t0,)))])
    plain = ModelRunner(v32, num_kv_blocks=8, block_size=8)
    expected = generate_greedy(plain, prompt, 6, table)[0]
    prefill, decode = start(v32, PrefillRole, "prefill", 2, 4), start(v32, DecodeRole, "decode",
                                                                        2, 8)
    try:
        assert decode.runner.kv_spec.has_index_k(decode.runner.kv_spec.num_layers - 1)
        seen = {}
        real = decode.runner.execute

        def spy(steps, *args, **kwargs):
            result = real(steps, *args, **kwargs)
            seen.setdefault("first", result.drafts[0])
            return result

        decode.runner.execute = spy
        spec = RequestSpec("v", tuple(prompt), SamplingParams(max_tokens=6, ignore_eos=True))
        assert run_pd(prefill, decode, spec) == (expected, "length")
        assert seen["first"] == first.drafts[0] and len(seen["first"]) == 2
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_pd_grammar_and_penalties_under_mtp_equal_plain(ckpt):
    """A regex-constrained, penalized greedy request through P -> D with MTP (prefill samples
    token 0 through the verify path, decode's matcher catches up on it) gives the tokens a
    colocated instance without MTP gives."""
    from engine.sampling_params import GrammarSpec  # noqa: PLC0415 (this test only)
    from tests.workers.test_spec_logits import run_all  # noqa: PLC0415

    params = SamplingParams(max_tokens=12, grammar=GrammarSpec("regex", r"[a-z]{2,5}-[0-9]{1,3}"),
                            repetition_penalty=1.5, presence_penalty=0.4)
    spec = RequestSpec("g", tuple(range(3100, 3113)), params)
    plain = make_rank(ckpt, 0)
    try:
        want = run_all(plain, [spec])["g"]
    finally:
        plain.shutdown()
    prefill = start(ckpt, PrefillRole, "prefill", 2, 4)
    decode = start(ckpt, DecodeRole, "decode", 2, 8)
    try:
        assert run_pd(prefill, decode, spec) == ([t for t, _ in want[0]], want[1])
    finally:
        prefill.shutdown()
        decode.shutdown()

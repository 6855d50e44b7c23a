"""MTP speculative decoding on a colocated rank in-process (TP=1, no Ray): greedy output with
drafts equals greedy output without, token for token, whatever the drafts are (MTP's own, or
an oracle's with planted mistakes so that drafts are kept and rejected KV rolled back), and
every block comes back."""

from __future__ import annotations

import pytest
import torch

from engine.request import RequestSpec
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.spec_forward import SpecForward
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Generate
from rank.rank import Rank
from tests.engine.engine_drive import generate_greedy
from tests.workers.test_colocated_rank import collect

PROMPTS = [list(range(1000, 1000 + n)) for n in (5, 23, 1, 17)]
MAX_TOKENS = [9, 4, 12, 7]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mtp"), seed=3, mtp_layers=1)


@pytest.fixture(scope="module")
def expected(ckpt):
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    return [generate_greedy(solo, p, m, tuple(range(8)))[0]
            for p, m in zip(PROMPTS, MAX_TOKENS)]


def make_rank(ckpt, k: int) -> Rank:
    scheduler = SchedulerConfig(block_size=4, num_kv_blocks=64, chunk_size=8,
                                max_num_batched_tokens=12 + 3 * k, max_num_seqs=3,
                                num_speculative_tokens=k)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=scheduler)
    rank = Rank(cfg, 0, ColocatedRole)
    host, port = rank.open_tp_store()
    rank.init_rank(host, port, [rank])
    rank.start()
    return rank


def run_all(rank) -> dict:
    for i, (p, m) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        rank.request(Generate(RequestSpec(f"r{i}", tuple(p),
                                          SamplingParams(max_tokens=m, ignore_eos=True))))
    return collect(rank, [f"r{i}" for i in range(len(PROMPTS))])


def oracle_drafts(monkeypatch, expected) -> None:
    """Drafts from the known greedy answer, wrong wherever ``position % 3 == 0`` (the MTP
    forwards still run, so its KV cache is written as in real use)."""
    seqs = {f"r{i}": p + e for i, (p, e) in enumerate(zip(PROMPTS, expected))}
    real = SpecForward._draft

    def drafts(self, steps):
        out = real(self, steps)
        fixed = []
        for s, d in zip(steps, out):
            seq = seqs[s.request_id]
            fixed.append(tuple(seq[p] if p % 3 else (seq[p] + 1) % 129280
                               for p in range(s.num_computed_tokens + 1,
                                              s.num_computed_tokens + 1 + len(d))))
        return fixed

    monkeypatch.setattr(SpecForward, "_draft", drafts)


@pytest.mark.parametrize("k", [1, 3])
def test_spec_greedy_equals_plain_greedy_with_oracle_drafts(ckpt, expected, monkeypatch, k):
    oracle_drafts(monkeypatch, expected)
    rank = make_rank(ckpt, k)
    try:
        got = run_all(rank)
        for i, exp in enumerate(expected):
            assert got[f"r{i}"] == (exp, "length", None)
        stats = rank.leader._step.spec_stats
        assert 0 < stats.accepted < stats.drafted  # kept and rejected drafts both happened
        rate, mean_len = stats.snapshot()
        assert 0 < rate < 1 and 1 < mean_len <= 1 + k
        st = rank.status()
        assert (st.spec_acceptance_rate, st.spec_mean_accepted_length) == (rate, mean_len)
        assert st.free_blocks == st.total_blocks == 64 and rank.leader.pool.num_live_sets == 0
    finally:
        rank.shutdown()


def test_spec_greedy_with_mtp_drafts_equals_plain(ckpt, expected):
    rank = make_rank(ckpt, 2)
    try:
        got = run_all(rank)
        for i, exp in enumerate(expected):
            assert got[f"r{i}"] == (exp, "length", None)
        assert rank.leader._step.spec_stats.drafted > 0
    finally:
        rank.shutdown()

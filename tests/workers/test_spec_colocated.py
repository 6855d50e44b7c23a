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
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Generate
from rank.rank import Rank
from tests.engine.engine_drive import generate_greedy
from tests.engine.spec_drive import oracle_drafts_of
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
    rank.start_alone()
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
    oracle_drafts_of(monkeypatch, seqs)


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


def test_ep_dp_ranks_with_mtp_step_in_lockstep(ckpt, expected):
    """Two colocated DP ranks (dp2 x tp1, ep: each holds half the routed experts, the MTP
    layer's included) with k = 2: one speculating while the other idles (its empty steps
    must meet every MTP and main forward's all-to-alls), then both; outputs equal plain
    greedy on one rank."""
    import threading  # noqa: PLC0415 (this test only)

    from rank.config import ParallelConfig  # noqa: PLC0415

    def cfg(dp_rank: int) -> InstanceConfig:
        return InstanceConfig(
            name=f"colocated-{dp_rank}", role="colocated", checkpoint_dir=str(ckpt),
            scheduler=SchedulerConfig(block_size=4, num_kv_blocks=64, chunk_size=8,
                                      max_num_batched_tokens=20, max_num_seqs=3,
                                      num_speculative_tokens=2),
            parallel=ParallelConfig(tp=1, dp=2, dp_rank=dp_rank, ep=True, step_timeout_s=60))

    ranks = [Rank(cfg(i), 0, ColocatedRole) for i in range(2)]
    host, port = ranks[0].open_ep_store()
    threads = [threading.Thread(target=r.init_rank, args=("127.0.0.1", 0, [r], (host, port)))
               for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r.runner is not None and r.dp_sync is not None for r in ranks)
    mtp = [sorted(map(int, r.runner.model.mtp.mlp.experts)) for r in ranks]
    assert mtp == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for r in ranks:
        r.start()
    try:
        def gen(rank, i):
            rank.request(Generate(RequestSpec(f"r{i}", tuple(PROMPTS[i]), SamplingParams(
                max_tokens=MAX_TOKENS[i], ignore_eos=True))))

        gen(ranks[0], 0)
        assert collect(ranks[0], ["r0"])["r0"] == (expected[0], "length", None)
        gen(ranks[0], 1)
        gen(ranks[1], 3)
        assert collect(ranks[0], ["r1"])["r1"] == (expected[1], "length", None)
        assert collect(ranks[1], ["r3"])["r3"] == (expected[3], "length", None)
        assert all(r.leader.broken is None for r in ranks)
        assert ranks[0].leader._step.spec_stats.drafted > 0
    finally:
        for r in ranks:
            r.shutdown()


def test_sampled_requests_speculate_and_a_seed_fixes_their_tokens(ckpt):
    """Sampled requests go through rejection sampling on the leader: full length, and the
    same seed gives the same tokens whatever shares the batch."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.95,
                            seed=11)
    runs = []
    for batch in (1, 3):
        rank = make_rank(ckpt, 2)
        try:
            for i in range(batch):
                rank.request(Generate(RequestSpec(f"s{i}", tuple(PROMPTS[1]), params)))
            got = collect(rank, [f"s{i}" for i in range(batch)])
            assert all(len(v[0]) == 10 and v[1] == "length" for v in got.values())
            runs.append(got["s0"][0])
            assert rank.leader.pool.num_live_sets == 0
        finally:
            rank.shutdown()
    assert runs[0] == runs[1]


def test_cut_at_stop_keeps_tokens_up_to_the_first_eos():
    from engine.spec_decode import cut_at_stop  # noqa: PLC0415 (this test only)

    eos = frozenset({1})
    assert cut_at_stop([5, 1, 7], eos, SamplingParams()) == [5, 1]
    assert cut_at_stop([5, 6, 7], eos, SamplingParams()) == [5, 6, 7]
    assert cut_at_stop([5, 1, 7], eos, SamplingParams(ignore_eos=True)) == [5, 1, 7]
    # NOTE: a kept draft in stop_token_ids stops too (engine.scheduler.finish_reason)
    stop = SamplingParams(ignore_eos=True, stop_token_ids=(6,))
    assert cut_at_stop([5, 6, 7], eos, stop) == [5, 6]

"""A colocated rank in-process (TP=1, no Ray): continuous batching with chunked prefill gives
each request the tokens it gets alone, and every block comes back."""

from __future__ import annotations

import time

import pytest
import torch

from rank.colocated import ColocatedRole
from rank.role import RankParts
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Abort, Generate, Reserve
from rank.rank import Rank
from engine.request import RequestSpec
from tests.engine.engine_drive import generate_greedy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def make_rank(ckpt, num_kv_blocks: int = 64) -> Rank:
    scheduler = SchedulerConfig(block_size=4, num_kv_blocks=num_kv_blocks, chunk_size=8,
                                max_num_batched_tokens=12, max_num_seqs=3)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=scheduler)
    rank = Rank(cfg, 0, ColocatedRole)
    rank.start_alone()
    return rank


def collect(rank, ids, timeout_s=60.0):
    """request id -> (tokens, finish reason, error), polling until all finished."""
    out = {i: ([], None, None) for i in ids}
    deadline = time.monotonic() + timeout_s
    while any(v[1] is None for v in out.values()):
        assert time.monotonic() < deadline, f"not finished: {out}"
        for ev in rank.poll(0.2):
            toks, _, _ = out[ev.request_id]
            out[ev.request_id] = (toks + list(ev.token_ids), ev.finish_reason, ev.error)
    return out


def test_batched_requests_match_solo_runs(ckpt):
    prompts = [list(range(1000, 1000 + n)) for n in (5, 23, 1, 17)]
    max_tokens = [6, 3, 8, 5]
    solo = ModelRunner(ckpt, num_kv_blocks=16, block_size=16)
    expected = [generate_greedy(solo, p, m, tuple(range(8)))[0]
                for p, m in zip(prompts, max_tokens)]
    rank = make_rank(ckpt)
    try:
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            rank.request(Generate(RequestSpec(f"r{i}", tuple(p),
                                      SamplingParams(max_tokens=m, ignore_eos=True))))
        got = collect(rank, [f"r{i}" for i in range(4)])
        for i, exp in enumerate(expected):
            assert got[f"r{i}"] == (exp, "length", None)
        st = rank.status()
        assert st.free_blocks == st.total_blocks == 64 and rank.leader.pool.num_live_sets == 0
    finally:
        rank.shutdown()


def test_too_big_request_is_refused_and_abort_frees(ckpt):
    rank = make_rank(ckpt, num_kv_blocks=8)
    try:
        rank.request(Generate(RequestSpec("big", tuple(range(40)), SamplingParams(max_tokens=4))))
        (ev,) = collect(rank, ["big"]).values()
        assert ev[1] == "error" and "num_kv_blocks" in ev[2]
        rank.request(Generate(RequestSpec("long", tuple(range(10)),
                                  SamplingParams(max_tokens=22, ignore_eos=True))))
        assert rank.request(Abort("long")) and not rank.request(Abort("long"))
        assert collect(rank, ["long"])["long"][1] == "abort"
        assert rank.leader.pool.num_free_blocks == 8 and rank.leader.pool.num_live_sets == 0
    finally:
        rank.shutdown()


def test_a_request_the_role_does_not_take_is_refused_by_name():
    """Requests are dispatched by type: one meant for another role never reaches a method."""
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir="",
                         scheduler=SchedulerConfig(block_size=4, num_kv_blocks=8, chunk_size=8,
                                                   max_num_batched_tokens=8, max_num_seqs=1))
    role = ColocatedRole(RankParts(cfg, 0, runner=None, leader=None))
    spec = RequestSpec("r", (1, 2), SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="colocated-0 is a colocated instance: it does not take "
                                        "Reserve"):
        role.handle(Reserve(spec))


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=8, ignore_eos=True),
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=11)])
def test_a_resumed_request_goes_on_with_the_same_tokens(ckpt, sampling):
    """Migration's contract on the worker side: prompt + the first k outputs as the prompt,
    ``num_resumed_tokens=k`` and the rest of max_tokens give the rest of the same output
    (greedy, and seeded sampling: the draw of output n is seeded (seed, n) either way)."""
    prompt, k = tuple(range(1000, 1013)), 3
    rank = make_rank(ckpt)
    try:
        rank.request(Generate(RequestSpec("whole", prompt, sampling)))
        whole, finish, _ = collect(rank, ["whole"])["whole"]
        assert finish == "length" and len(whole) == 8
        rest_sampling = SamplingParams(**{**sampling.__dict__, "max_tokens": 8 - k})
        rank.request(Generate(RequestSpec("rest", prompt + tuple(whole[:k]), rest_sampling,
                                          num_resumed_tokens=k)))
        rest, finish, _ = collect(rank, ["rest"])["rest"]
        assert finish == "length" and whole[:k] + rest == whole
    finally:
        rank.shutdown()

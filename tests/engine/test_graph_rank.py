"""Graph mode through a rank: the InstanceConfig's graph section reaches the rank's runner
(``init_rank``), whose decode steps then run captured, with the tokens of eager runs."""

from __future__ import annotations

import time

import torch

from engine.graph import GraphConfig
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Generate
from rank.rank import Rank
from engine.request import RequestSpec
from tests.engine.engine_drive import generate_greedy
from tests.engine.test_graph import backends, dense_ckpt  # noqa: F401 (fixtures)


def _collect(rank: Rank, ids: list[str], timeout_s: float = 60.0) -> dict:
    """request id -> tokens, polling until every request finished."""
    out, done = {i: [] for i in ids}, set()
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        assert time.monotonic() < deadline, f"not finished: {out}"
        for ev in rank.poll(0.2):
            assert ev.error is None, ev.error
            out[ev.request_id] += list(ev.token_ids)
            if ev.finish_reason is not None:
                done.add(ev.request_id)
    return out


def test_colocated_rank_decodes_through_the_captured_forward(dense_ckpt, backends):  # noqa: F811
    torch.set_num_threads(1)
    prompts, max_tokens = [list(range(100, 105)), list(range(200, 209))], [6, 4]
    solo = ModelRunner(dense_ckpt, num_kv_blocks=16, block_size=16)
    expected = [generate_greedy(solo, p, m, tuple(range(4)))[0]
                for p, m in zip(prompts, max_tokens)]
    scheduler = SchedulerConfig(block_size=4, num_kv_blocks=32, chunk_size=16,
                                max_num_batched_tokens=32, max_num_seqs=2)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(dense_ckpt),
                         scheduler=scheduler,
                         graph=GraphConfig(enabled=True, batch_sizes=(2,), backend="counting"))
    rank = Rank(cfg, 0, ColocatedRole)
    rank.start_alone()
    try:
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            rank.request(Generate(RequestSpec(f"r{i}", tuple(p),
                                      SamplingParams(max_tokens=m, ignore_eos=True))))
        got = _collect(rank, ["r0", "r1"])
        assert [got["r0"], got["r1"]] == expected
        assert backends["counting"].calls >= 3  # decode steps ran captured (padded when 1)
        assert rank.runner.kv_cache.scratch_block == 32
    finally:
        rank.shutdown()

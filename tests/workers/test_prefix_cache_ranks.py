"""Prefix cache through real ranks in-process (no Ray): colocated outputs with the cache on
equal the cache off and HF transformers for prefixes shared at every length relative to the
block; PD equals colocated; a second conversation turn reuses the decode side's KV (only the
rest is shipped) and equals a fresh request; small pools with many prefixes and aborts leave
every block free and every reference count at zero."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Abort, Generate, Prefill, Reservation, Reserve
from rank.rank import Rank
from tests.leaks import wait_ranks_idle
from tests.workers.test_colocated_rank import collect
from tests.workers.test_pd_ranks import run_pd, start

BLOCK = 4
BASE = list(range(1000, 1013))  # 13 tokens: 3 full blocks + 1
# prefixes shared with BASE: 0, 1, block - 1, block, block + 1 tokens; then BASE repeated
SHARED = (0, 1, BLOCK - 1, BLOCK, BLOCK + 1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def colocated(ckpt, prefix_cache: bool, blocks: int = 64) -> Rank:
    sched = SchedulerConfig(block_size=BLOCK, num_kv_blocks=blocks, chunk_size=8,
                            max_num_batched_tokens=12, max_num_seqs=4,
                            prefix_cache=prefix_cache)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=sched)
    rank = Rank(cfg, 0, ColocatedRole)
    rank.start_alone()
    return rank


def prompts() -> list[list[int]]:
    out = [BASE]
    for n in SHARED:
        out.append(BASE[:n] + list(range(3000 + 10 * n, 3000 + 10 * n + 13 - n)))
    return out + [BASE]


def run_one(rank, rid, prompt, sampling):
    """Tokens and the first event's cached count of one request run alone."""
    rank.request(Generate(RequestSpec(rid, tuple(prompt), sampling)))
    events = []
    while not events or events[-1].finish_reason is None:
        events += [e for e in rank.poll(0.2) if e.request_id == rid]
    assert events[-1].error is None, events[-1]
    return [t for e in events for t in e.token_ids], events[0].num_cached_tokens


def assert_idle(rank):
    wait_ranks_idle(rank)
    assert rank.leader.pool.num_referenced_blocks == 0


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=5, ignore_eos=True),
                                      SamplingParams(max_tokens=5, ignore_eos=True,
                                                     temperature=0.9, seed=11)],
                         ids=["greedy", "seeded"])
def test_cache_on_equals_cache_off_and_hf(ckpt, sampling):
    ps = prompts()
    got = {}
    for on in (False, True):
        rank = colocated(ckpt, on)
        try:
            got[on] = [run_one(rank, f"r{i}", p, sampling) for i, p in enumerate(ps)]
            assert_idle(rank)
        finally:
            rank.shutdown()
    assert [t for t, _ in got[True]] == [t for t, _ in got[False]]
    cached = [c for _, c in got[True]]
    # shared 0 / 1 / 3 -> nothing; 4 / 5 -> one block; BASE again -> 3 blocks (12 of 13)
    assert cached == [0, 0, 0, 0, 4, 4, 12], cached
    assert all(c == 0 for _, c in got[False])
    if sampling.temperature == 0:
        hf = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        for p, (tokens, _) in zip(ps, got[True]):
            with torch.no_grad():
                ref = hf.generate(torch.tensor([p]), max_new_tokens=5, min_new_tokens=5,
                                  do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            assert tokens == ref


@pytest.fixture(scope="module")
def v32_ckpt(tmp_path_factory):
    from orchestrator.cli import main  # noqa: PLC0415 (only this fixture needs the CLI)

    out = tmp_path_factory.mktemp("v32") / "v32"
    assert main(["model", "init-tiny", "--arch", "deepseek_v32", "--seed", "3", str(out)]) == 0
    return out


def test_v32_index_keys_are_reused_with_the_blocks(v32_ckpt):
    """DeepSeek-V3.2: the indexer's keys live in the same blocks; prompts past index_topk
    (32) so the sparse selection reads cached keys; cache on == cache off."""
    base = list(range(2000, 2048))
    ps = [base, base[:40] + list(range(5000, 5010)), base[:33] + [7] * 20, base]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    got = {}
    for on in (False, True):
        rank = colocated(v32_ckpt, on)
        try:
            got[on] = [run_one(rank, f"r{i}", p, sampling) for i, p in enumerate(ps)]
            assert_idle(rank)
        finally:
            rank.shutdown()
    assert [t for t, _ in got[True]] == [t for t, _ in got[False]]
    assert [c for _, c in got[True]] == [0, 40, 32, 44]


def test_small_pool_many_prefixes_and_aborts_leave_nothing(ckpt):
    """12 blocks of 4 for 4 requests of up to 4 blocks: cached blocks are evicted all the time;
    outputs equal the cache off, an abort mid-run frees its blocks, refcounts end at zero."""
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    ps = [[7] * (1 + i % 3) + list(range(100 * i, 100 * i + 9)) for i in range(10)]
    ps += [p[:8] + [5, 6] for p in ps[:4]]
    got = {}
    for on in (False, True):
        rank = colocated(ckpt, on, blocks=12)
        try:
            for i, p in enumerate(ps):
                rank.request(Generate(RequestSpec(f"r{i}", tuple(p), sampling)))
            rank.request(Generate(RequestSpec("gone", tuple(ps[0]), SamplingParams(
                max_tokens=26, ignore_eos=True))))
            rank.request(Abort("gone"))
            out = collect(rank, [f"r{i}" for i in range(len(ps))] + ["gone"])
            got[on] = {rid: v for rid, v in out.items() if rid != "gone"}
            assert out["gone"][1] == "abort"
            assert_idle(rank)
        finally:
            rank.shutdown()
    assert got[True] == got[False]


@pytest.fixture
def pd_cached(ckpt):
    prefill = start(PrefillRole, ckpt, "prefill")
    decode = start(DecodeRole, ckpt, "decode")
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def test_pd_second_turn_reuses_decode_kv_and_equals_colocated(ckpt, pd_cached):
    prefill, decode = pd_cached
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    solo = colocated(ckpt, prefix_cache=False)
    try:
        turn1 = BASE
        want1, _ = run_one(solo, "c1", turn1, sampling)
        turn2 = turn1 + want1 + [41, 42, 43]
        want2, _ = run_one(solo, "c2", turn2, sampling)
    finally:
        solo.shutdown()
    assert run_pd(prefill, decode, RequestSpec("t1", tuple(turn1), sampling)) == \
        (want1, "length")
    wait_ranks_idle(prefill, decode)
    sent1 = prefill.status().kv_bytes_sent
    spec2 = RequestSpec("t2", tuple(turn2), sampling)
    # the decode side holds turn 1's prompt + output blocks: 13 + 6 tokens, KV for 18 -> 16
    probe = RequestSpec("probe", spec2.prompt_token_ids, sampling)
    held = decode.request(Reserve(probe, 1))
    assert isinstance(held, Reservation) and held.num_cached_tokens == 16
    assert decode.request(Abort("probe"))
    assert run_pd(prefill, decode, spec2) == (want2, "length")
    wait_ranks_idle(prefill, decode)
    kv = prefill.runner.kv_spec
    per_token = kv.num_layers * kv.bytes_per_token_per_layer
    assert sent1 == len(turn1) * per_token
    # only tokens [16, 22) are shipped (prefill itself had [0, 12) cached, so it computes
    # [12, 22) and ships from 16)
    assert prefill.status().kv_bytes_sent - sent1 == (len(turn2) - 16) * per_token
    for rank in (prefill, decode):
        assert rank.leader.pool.num_referenced_blocks == 0


def test_decode_cache_beyond_prefill_cache_ships_cached_prefill_tokens(ckpt, pd_cached):
    """Prefill holds more than decode (decode's cache was evicted): the first chunk carries
    prefill's cached tokens the decode side lacks; output still equals colocated."""
    prefill, decode = pd_cached
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    solo = colocated(ckpt, prefix_cache=False)
    try:
        want, _ = run_one(solo, "c", BASE, sampling)
    finally:
        solo.shutdown()
    assert run_pd(prefill, decode, RequestSpec("a", tuple(BASE), sampling))[0] == want
    wait_ranks_idle(prefill, decode)
    # evict decode's cache by filling its pool once
    pool = decode.leader.pool
    with decode.leader.lock:
        pool.free(pool.allocate(pool.num_blocks))
    assert pool.num_cached_blocks == 0 and prefill.leader.pool.num_cached_blocks >= 3
    assert run_pd(prefill, decode, RequestSpec("b", tuple(BASE), sampling))[0] == want
    wait_ranks_idle(prefill, decode)


def test_abort_mid_transfer_into_a_reservation_with_cached_blocks(ckpt, pd_cached):
    """Turn 2 reuses turn 1's blocks on both sides; aborted after its first prefill chunk
    (its KV in flight): both sides end with every reference count at zero, turn 1's blocks
    still cached, and turn 2 run again equals colocated."""
    prefill, decode = pd_cached
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    out1, _ = run_pd(prefill, decode, RequestSpec("t1", tuple(BASE), sampling))
    turn2 = (*BASE, *out1, *range(6000, 6030))  # 49 tokens: prefill computes 12.. in chunks of 8
    wait_ranks_idle(prefill, decode)
    first_chunk_ran, resume = threading.Event(), threading.Event()
    step = prefill.role.step

    def step_then_hold() -> bool:
        busy = step()
        if busy and not first_chunk_ran.is_set():
            first_chunk_ran.set()
            resume.wait(10)
        return busy

    prefill.role.step = step_then_hold
    spec = RequestSpec("ab", turn2, sampling)
    res = decode.request(Reserve(spec, 1))
    assert res.num_cached_tokens == 16
    prefill.request(Prefill(spec, res))
    try:
        assert first_chunk_ran.wait(10)
        assert prefill.request(Abort("ab")) is True
    finally:
        resume.set()
        prefill.role.step = step
    assert decode.request(Abort("ab"))
    wait_ranks_idle(prefill, decode)
    for rank in (prefill, decode):
        assert rank.leader.pool.num_referenced_blocks == 0
    assert decode.leader.pool.num_cached_blocks >= 4  # turn 1: 18 tokens of KV -> 4 blocks
    solo = colocated(ckpt, prefix_cache=False)
    try:
        want, _ = run_one(solo, "c", turn2, sampling)
    finally:
        solo.shutdown()
    assert run_pd(prefill, decode, RequestSpec("again", turn2, sampling)) == (want, "length")
    wait_ranks_idle(prefill, decode)

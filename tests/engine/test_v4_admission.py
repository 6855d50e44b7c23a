"""DeepSeek-V4 admission by per-group blocks (engine/v4/admission.py) through the scheduler:
a request commits the most blocks per group it will hold (not its context's), one that does
not fit waits, one that can never fit is refused naming the group, and the commitment goes
back exactly once with the scheduler's free."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, DoubleFreeError
from engine.request import Request, RequestSpec
from engine.runner import build_runner
from engine.sampling_params import SamplingParams
from engine.scheduler import COLOCATED, PREFILL, Scheduler
from engine.v4.block_table import group_bytes
from engine.v4.kv_spec import PER_REQUEST, layer_specs
from engine.v4.staging import staged_rows, staging_bytes, staging_bytes_per_slot

BLOCK = 16


def _scheduler(ckpt, policy=COLOCATED, staged: bool = False, blocks: int = 3):
    """A scheduler over a V4 runner's pools of ``blocks`` blocks, wired as rank.py does."""
    runner = build_runner(ckpt, num_kv_blocks=blocks, block_size=BLOCK)
    pool = BlockPool(blocks, BLOCK)
    pool.on_free = runner.release
    sched = Scheduler(pool, policy, chunk_size=8, max_num_batched_tokens=16, max_num_seqs=4)
    sched.admission = runner.make_admission(BLOCK, staged=staged)
    return sched, runner


def _req(rid: str, prompt: int, max_tokens: int) -> Request:
    return Request(RequestSpec(rid, tuple(range(1, prompt + 1)),
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def test_commits_what_it_holds_waits_and_releases_once(tiny_v4_ckpt):
    """21 + 32 tokens (window 8, chunks of 8, blocks of 16): window 2 blocks (7 kept + 8,
    +1 for the edge), CSA entries 53 // 4 = 13 rows, HCA 3 rows, state 1 each: one scheduler
    block. A second such request does not fit the window pool of 3 until the first is freed."""
    sched, runner = _scheduler(tiny_v4_ckpt)
    a, b = _req("a", 21, 32), _req("b", 21, 32)
    assert sched.allocate(a) is not None and len(a.blocks) == 1
    assert runner.admission.committed() == {
        "window": 2, "entries/compressed_sparse_attention": 1,
        "state/compressed_sparse_attention": 1, "entries/heavily_compressed_attention": 1,
        "state/heavily_compressed_attention": 1}
    assert sched.allocate(b) is None and b.blocks is None
    assert "window: 2 needed, 1 of 3 uncommitted" in \
        runner.admission.describe(sched.admission_need(b.spec))
    blocks = a.blocks
    sched.pool.free(blocks)
    assert not any(runner.admission.committed().values())
    with pytest.raises(DoubleFreeError):
        sched.pool.free(blocks)
    assert not any(runner.admission.committed().values())  # NOTE: not given back twice
    assert sched.allocate(b) is not None
    with pytest.raises(ValueError, match="already committed"):
        sched.admission.commit(b.blocks, {"window": 1})


def test_never_fits_is_refused_naming_the_group(tiny_v4_ckpt):
    """21 + 300 tokens: 80 CSA entries = 5 blocks of 16 > 3 in all (the window still 2)."""
    sched, _ = _scheduler(tiny_v4_ckpt)
    reason = sched.refusal(_req("big", 21, 300).spec)
    assert "entries/compressed_sparse_attention: 5, 3" in reason
    assert "window" not in reason and "raise num_kv_blocks" in reason
    assert sched.refusal(_req("ok", 21, 32).spec) is None


def test_pd_roles_take_staging_slots_prefill_commits_the_prompt(tiny_v4_ckpt):
    """A PD role's scheduler blocks carry the staging rows; prefill commits the prompt's
    blocks only (it never decodes)."""
    sched, runner = _scheduler(tiny_v4_ckpt, PREFILL, staged=True, blocks=8)
    req = _req("p", 100, 1000)
    assert sched.blocks_for(req.spec) == \
        -(-staged_rows(runner.model.config, 100) // BLOCK)
    assert sched.admission_need(req.spec)["entries/compressed_sparse_attention"] == \
        -(-(100 // 4) // BLOCK)


def test_staging_pool_has_its_own_size_and_bytes(tiny_v4_ckpt):
    """``staging_blocks`` sizes the staging cache and the scheduler pool over it (not
    ``num_kv_blocks``, which sizes the group pools); ``staging_bytes`` is its allocation."""
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=8, block_size=BLOCK, staging_blocks=2)
    config = runner.model.config
    assert runner.scheduler_blocks == runner.kv_spec.num_blocks == 2
    assert all(p.num_blocks == 8 for p in runner.pools.values())
    allocated = sum(b.numel() * b.element_size()
                    for layer in range(config.num_hidden_layers)
                    for b in runner.kv_cache.layer_buffers(layer))
    assert allocated == staging_bytes(config, 2, BLOCK, 4)  # NOTE: fp32
    assert staging_bytes_per_slot(config, 4) == \
        runner.kv_spec.bytes_per_token_of(range(config.num_hidden_layers))
    assert build_runner(tiny_v4_ckpt, num_kv_blocks=8, block_size=BLOCK).scheduler_blocks == 8


def test_group_bytes_are_what_the_pools_allocate(tiny_v4_ckpt):
    """``group_bytes``: window and entries = PagedKV's tensors; a state block = one request's
    largest open-group state (the specs' per-request rows x widths)."""
    runner = build_runner(tiny_v4_ckpt, num_kv_blocks=5, block_size=BLOCK)
    config, kv = runner.model.config, runner.kv
    got = group_bytes(config, 5, BLOCK, 4)
    stored = [kv.window, *kv.entries.values(), *kv.index_keys.values()]
    assert sum(v for k, v in got.items() if not k.startswith("state/")) == \
        sum(t.numel() * t.element_size() for t in stored)
    state = sum(t.rows * t.width for s in layer_specs(config) for t in s.tensors()
                if t.per == PER_REQUEST)
    assert sum(v for k, v in got.items() if k.startswith("state/")) == 5 * state * 4


def test_the_leaders_frames_carry_the_uncommitted_group_blocks_a_waiter_needs(tiny_v4_ckpt):
    """The real path from a V4 decode's admission to the router's queue: the leader's frames
    (rank/leader.py flush_events) carry V4Admission's uncommitted blocks per group; fed to the
    router's AdmissionQueue they hold a waiter with the refused request's group need while the
    first request runs, and grant it in the frame that reports its free."""
    import asyncio
    import queue as queues
    import time
    import types

    from orchestrator.router.admission import AdmissionQueue
    from rank.event_stream import EventStream
    from rank.leader import Leader

    sched, runner = _scheduler(tiny_v4_ckpt)
    leader = object.__new__(Leader)  # NOTE: only the event path's state
    leader.stream, leader._events = EventStream("decode-0", "127.0.0.1"), queues.Queue()
    leader.wake, leader.pool, leader.scheduler = None, sched.pool, sched
    leader.ranks = types.SimpleNamespace(followers=[])
    a, b = _req("a", 21, 32), _req("b", 21, 32)
    try:
        leader.stream.open("router-a")
        assert sched.allocate(a) is not None and sched.allocate(b) is None
        leader.flush_events()
        held = sched.admission_need(b.spec)
        sched.pool.free(a.blocks)
        leader.flush_events()
        frames = [list(f) for f in leader.stream._outboxes["router-a"].frames]
    finally:
        leader.stream.close()
    totals = {name: pool.num_blocks for name, pool in runner.pools.items()}
    assert frames[-1][5] == totals and frames[0][5]["window"] == totals["window"] - 2

    async def go():
        queue, grants = AdmissionQueue(4), []
        queue.order = lambda: ["decode-0"]
        queue.report("decode-0", frames[0][1], frames[0][5])  # a runs
        async with queue.ticket("b") as ticket:
            wait = asyncio.ensure_future(ticket.wait(time.monotonic() + 60, "full", 1, held))
            while ticket.waiter is None:
                await asyncio.sleep(0)
            grants.append(ticket.waiter.granted.done())
            queue.report("decode-0", frames[1][1], frames[1][5])  # a freed
            grants.append(ticket.waiter.granted.done())
            return grants, await asyncio.wait_for(wait, 5)

    assert frames[0][1] >= 1  # NOTE: the scheduler pool has room: only the groups hold b
    assert asyncio.run(go()) == ([False, True], "decode-0")

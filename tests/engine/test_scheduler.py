"""Scheduler: chunked prefill budgets, decode-first ordering, role policies, no block leaks."""

from engine.block_pool import BlockPool
from engine.sampling_params import SamplingParams
from engine.scheduler import COLOCATED, DECODE, PREFILL, Scheduler, finish_reason
from engine.request import Request
from engine.request import RequestSpec
from tests.leaks import assert_scheduler_empty


def spec(rid, n_prompt, max_tokens=4, ignore_eos=False):
    return RequestSpec(rid, tuple(range(100, 100 + n_prompt)),
                       SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))


def run_to_end(sched, token=7):
    """Drive the scheduler as a leader would; returns the step token counts."""
    counts = []
    while True:
        out = sched.schedule()
        if not out:
            return counts
        counts.append(out.num_tokens)
        sampled = {c.request.request_id: token for c in out.chunks if c.completes}
        sched.update(out, sampled)
        for rid in sampled:
            req = sched.find(rid)
            if finish_reason(req, frozenset()) or sched.policy.stop_after_first_token:
                sched.remove(rid)


def test_chunked_prefill_respects_chunk_and_budget():
    pool = BlockPool(64, 4)
    s = Scheduler(pool, PREFILL, chunk_size=8, max_num_batched_tokens=12, max_num_seqs=8)
    s.add(Request(spec("a", 20)))
    s.add(Request(spec("b", 5)))
    counts = run_to_end(s)
    assert max(counts) <= 12 and sum(counts) == 25
    out_first = counts[0]
    assert out_first == 12  # a: 8 (chunk cap) + b: 4 (budget left)
    assert_scheduler_empty(s)


def test_steps_carry_positions_and_block_tables():
    pool = BlockPool(16, 4)
    s = Scheduler(pool, COLOCATED, chunk_size=3, max_num_batched_tokens=3, max_num_seqs=2)
    s.add(Request(spec("a", 5, max_tokens=2)))
    out = s.schedule()
    (step,) = out.steps
    assert step.token_ids == (100, 101, 102) and step.num_computed_tokens == 0
    assert len(step.block_ids) == pool.blocks_needed(5 + 2)  # colocated reserves outputs
    s.update(out, {})
    step2 = s.schedule().steps[0]
    assert step2.token_ids == (103, 104) and step2.num_computed_tokens == 3


def test_decode_tokens_go_before_prefill_chunks():
    pool = BlockPool(64, 4)
    s = Scheduler(pool, COLOCATED, chunk_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    s.add(Request(spec("long", 40)))
    r = Request(spec("dec", 3), output_token_ids=[9], num_computed_tokens=3,
                blocks=pool.allocate(2))
    s.add(r)
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["dec", "long"]
    assert out.chunks[0].end - out.chunks[0].start == 1
    assert out.num_tokens == 16


def test_admission_waits_for_blocks_and_is_fifo():
    pool = BlockPool(4, 4)
    s = Scheduler(pool, COLOCATED, chunk_size=64, max_num_batched_tokens=64, max_num_seqs=4)
    s.add(Request(spec("big", 10, max_tokens=2)))   # 3 blocks
    s.add(Request(spec("next", 6, max_tokens=2)))   # 2 blocks: must wait
    s.schedule()
    assert [r.request_id for r in s.running] == ["big"] and len(s.waiting) == 1
    run_to_end(s)
    assert_scheduler_empty(s)


def test_decode_role_runs_from_received_kv_to_max_tokens():
    pool = BlockPool(8, 4)
    s = Scheduler(pool, DECODE, chunk_size=8, max_num_batched_tokens=8, max_num_seqs=4)
    sp = spec("d", 6, max_tokens=3)
    req = Request(sp, output_token_ids=[11], num_computed_tokens=6,
                  blocks=pool.allocate(s.blocks_for(sp)))
    s.add(req)
    counts = run_to_end(s)
    assert counts == [1, 1] and req.output_token_ids == [11, 7, 7]
    assert_scheduler_empty(s)


def test_finish_reasons():
    r = Request(spec("x", 2, max_tokens=3), output_token_ids=[5])
    assert finish_reason(r, frozenset({5})) == "stop"
    assert finish_reason(Request(spec("y", 2, 3, ignore_eos=True), [5]), frozenset({5})) is None
    assert finish_reason(Request(spec("z", 2, 2), [1, 2]), frozenset()) == "length"

"""Prefix cache in the block pool and the scheduler: chained hashes, reference counts, LRU
eviction only under need, the last prompt token always computed, events net of each other."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, DoubleFreeError
from engine.prefix_hash import block_hashes, cache_salt
from engine.request import Request, RequestSpec
from engine.sampling_params import SamplingParams
from engine.scheduler import COLOCATED, PREFILL, Scheduler
from tests.leaks import assert_pool_empty, assert_scheduler_empty

SALT = cache_salt("ckpt", "float32")


def test_hashes_chain_the_whole_prefix():
    a = block_hashes(list(range(12)), 4, SALT)
    b = block_hashes([0, 1, 2, 3, 9, 5, 6, 7, 8, 9, 10, 11], 4, SALT)
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]  # chained
    assert block_hashes(list(range(12)), 4, cache_salt("other")) [0] != a[0]  # salted
    assert block_hashes(list(range(13)), 4, SALT, parents=a[:2]) == a  # incremental
    assert block_hashes(list(range(3)), 4, SALT) == []


def test_cached_blocks_are_reused_refcounted_and_evicted_lru_only_when_needed():
    pool = BlockPool(6, 4, salt=SALT)
    h = block_hashes(list(range(8)), 4, SALT)
    a = pool.allocate(3)
    pool.cache_blocks(a, 0, h)
    b = pool.allocate(3, h)  # shares a's two cached blocks
    assert b.num_cached == 2 and b.block_ids[:2] == a.block_ids[:2]
    assert pool.num_free_blocks == 6 - 4
    pool.free(a)
    pool.free(b)
    assert_pool_empty(pool)
    assert pool.num_cached_blocks == 2 and pool.cached_prefix(h) == 2
    c = pool.allocate(4)  # 4 uncached blocks are free: the cached ones survive
    assert pool.cached_prefix(h) == 2
    assert not pool.can_allocate(3) and pool.can_allocate(2, h[:1]) is True
    d = pool.allocate(1)  # evicts the LRU cached block: the tail (h[1]) goes first
    assert pool.cached_prefix(h) == 1 and pool.num_cached_blocks == 1
    for s in (c, d):
        pool.free(s)
    with pytest.raises(DoubleFreeError):
        pool.free(d)
    assert_pool_empty(pool)
    assert pool.num_referenced_blocks == 0


def test_events_report_stores_and_evictions_net():
    pool = BlockPool(2, 4, salt=SALT)
    first = pool.take_events()
    assert first.reset and first.stored == ()  # a new pool: the router forgets the old one
    h = block_hashes(list(range(8)), 4, SALT)
    a = pool.allocate(2)
    pool.cache_blocks(a, 0, h)
    pool.free(a)
    ev = pool.take_events()
    assert (set(ev.stored), ev.removed, ev.reset) == (set(h), (), False)
    pool.free(pool.allocate(2))  # both evicted
    ev = pool.take_events()
    assert (ev.stored, set(ev.removed)) == ((), set(h))
    assert BlockPool(2, 4).take_events() is None  # cache off


def _spec(rid, prompt, max_tokens=2):
    return RequestSpec(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens,
                                                          ignore_eos=True))


def _run(sched, req):
    """Drive one request to its end; returns the (start, end) of every chunk it ran."""
    sched.add(req)
    ranges = []
    while True:
        out = sched.schedule()
        if not out:
            return ranges
        ranges += [(c.start, c.end) for c in out.chunks]
        sampled = {c.request.request_id: 7 for c in out.chunks if c.completes}
        sched.update(out, sampled)
        if req.output_token_ids and (sched.policy.stop_after_first_token or
                                     len(req.output_token_ids) >= req.spec.sampling.max_tokens):
            sched.remove(req.request_id)


@pytest.mark.parametrize("shared,cached", [(0, 0), (1, 0), (3, 0), (4, 4), (5, 4), (9, 8)])
def test_scheduler_starts_at_the_cached_length(shared, cached):
    """Block 4: prefixes of 0, 1, block-1, block, block+1, two blocks + 1 tokens shared."""
    sched = Scheduler(BlockPool(32, 4, salt=SALT), PREFILL, chunk_size=64,
                      max_num_batched_tokens=64, max_num_seqs=4)
    _run(sched, Request(_spec("a", range(100, 112))))
    b = Request(_spec("b", [*range(100, 100 + shared), *range(500, 512 - shared)]))
    ranges = _run(sched, b)
    assert b.num_cached_tokens == cached and ranges == [(cached, 12)]
    assert_scheduler_empty(sched)


def test_whole_prompt_repeated_still_computes_its_last_token_and_output_blocks_cache():
    sched = Scheduler(BlockPool(32, 4, salt=SALT), COLOCATED, chunk_size=64,
                      max_num_batched_tokens=64, max_num_seqs=4)
    a = Request(_spec("a", range(8), max_tokens=6))
    _run(sched, a)
    again = Request(_spec("again", range(8)))
    assert _run(sched, again)[0] == (4, 8) and again.num_cached_tokens == 4
    # prompt + output of a (8 + 6 tokens, KV for 13) filled 3 blocks: a next turn finds them
    turn2 = Request(_spec("t2", [*range(8), *a.output_token_ids, 1, 2, 3]))
    assert _run(sched, turn2)[0] == (12, 17) and turn2.num_cached_tokens == 12
    assert_scheduler_empty(sched)


def test_cache_off_computes_everything():
    sched = Scheduler(BlockPool(32, 4), PREFILL, chunk_size=64, max_num_batched_tokens=64,
                      max_num_seqs=4)
    _run(sched, Request(_spec("a", range(12))))
    b = Request(_spec("b", range(12)))
    assert _run(sched, b) == [(0, 12)] and b.num_cached_tokens == 0
    assert_scheduler_empty(sched)


def test_events_past_their_bound_become_a_reset_with_every_cached_hash():
    pool = BlockPool(2, 4, salt=SALT)  # at most 8 pending hashes
    pool.take_events()
    for i in range(6):  # 6 x (2 stored + up to 2 evicted) > 8
        h = block_hashes(list(range(100 * i, 100 * i + 8)), 4, SALT)
        a = pool.allocate(2)
        pool.cache_blocks(a, 0, h)
        pool.free(a)
    ev = pool.take_events()
    assert ev.reset and set(ev.stored) == set(h) and ev.removed == ()

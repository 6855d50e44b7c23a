"""benchmarks/prefix_cache_bounded.py: the offline replay against bounded prefix caches (the
engine's BlockPool) serves a request as the scheduler does, evicts least-recently-freed blocks,
with pools that never evict agrees with prefix_cache_ceiling.py's independent unbounded replay
on a hand-made trace, places and measures balance on it as worked out by hand."""

from __future__ import annotations

import json

import pytest

from benchmarks import prefix_cache_bounded as bounded
from benchmarks import prefix_cache_ceiling as ceiling
from benchmarks.prefix_trace import BLOCK
from engine.block_pool import BlockPool

# Mooncake rows (512-token trace blocks; scaled: 64 tokens = 4 KV blocks of 16 a block):
# conversation 1 in three turns, conversation 2 in two, all sharing system block 0
ROWS = [(0, 1536, [0, 1, 2]), (3000, 1536, [0, 7, 8]), (6000, 2048, [0, 1, 2, 3]),
        (6000, 2048, [0, 7, 8, 9]), (9000, 2560, [0, 1, 2, 3, 4])]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 1,
                                        "hash_ids": ids}) + "\n" for t, n, ids in ROWS))
    return path


def prompt(tokens: int, first_key: int) -> bounded.KVPrompt:
    return bounded.KVPrompt(0, tokens, tuple(range(first_key, first_key + tokens // BLOCK)))


def test_serve_reuses_the_prefix_and_evicts_the_least_recently_freed_tail():
    a, b = prompt(33, 0), prompt(33, 100)  # 2 full blocks + 1 token; 3 blocks with its output
    pool = BlockPool(4, BLOCK, salt=1)
    assert bounded.serve(pool, a, 1) == 0
    assert bounded.serve(pool, a, 1) == 32  # the last token is computed: at most 2 blocks
    bounded.serve(pool, b, 1)  # 2 uncached free, then a's tail block evicted first
    assert bounded.serve(pool, a, 1) == 16
    roomy = BlockPool(6, BLOCK, salt=1)
    for p in (a, b):
        bounded.serve(roomy, p, 1)
    assert bounded.serve(roomy, a, 1) == 32
    assert roomy.num_referenced_blocks == 0 and roomy.num_live_sets == 0


def test_never_evicting_pools_agree_with_the_unbounded_ceiling(trace):
    reqs = bounded.kv_prompts(trace, 0, 1, 16)
    assert [len(p.hashes) for p in reqs] == [12, 12, 16, 16, 20]
    assert bounded.working_set(reqs) == 12 + 8 + 4 + 4 + 4
    assert [len(t) for t in bounded.ticks(reqs)] == [1, 1, 2, 1]
    big = bounded.working_set(reqs) + bounded.min_blocks(reqs, 1)
    old = ceiling.prompts(trace, 0, 1, 16)
    total = sum(p.length for p in old)
    for dp, placement in [(1, "one cache"), (2, "round_robin"), (2, "longest prefix")]:
        expect = ceiling.hit_rate(ceiling.replay(old, dp, placement), total)
        got = bounded.replay(reqs, dp if placement != "one cache" else 1, placement,
                             big).hit_rate
        assert got == pytest.approx(expect), placement
    # by hand: one cache hits 64 (the shared block) + 192 + 192 + 256 of 1216 tokens
    assert bounded.replay(reqs, 1, "one cache", big).hit_rate == pytest.approx(704 / 1216)


def test_placements_by_hand_kv_aware_keeps_a_turn_with_its_cache_under_cached_load(trace):
    reqs = bounded.kv_prompts(trace, 0, 1, 16)
    big = bounded.working_set(reqs) + bounded.min_blocks(reqs, 1)

    def hit(placement: str) -> float:
        return bounded.replay(reqs, 2, placement, big).hit_rate

    # round robin: c1t1 i0, c2t1 i1 (0), c1t2 i0 (192), c2t2 i1 (192), c1t3 i0 (256)
    assert hit("round_robin") == pytest.approx(640 / 1216)
    # longest prefix: everything on i0, as one cache
    assert hit("longest prefix") == pytest.approx(704 / 1216)
    # kv_aware: c2t2 arrives in c1t2's tick, when i0 already carries c1t2, which computes
    # there only its 64 uncached tokens: cost on i0 (256 - 192) + 64 < 256 on idle i1 -> i0
    assert hit("kv_aware") == pytest.approx(704 / 1216)
    # counting c1t2's whole prompt as i0's load: (256 - 192) + 256 > 256 -> i1, no hit
    assert hit(bounded.PROMPT_LOAD) == pytest.approx(512 / 1216)


def test_imbalance_by_hand(trace):
    reqs = bounded.kv_prompts(trace, 0, 1, 16)
    big = bounded.working_set(reqs) + bounded.min_blocks(reqs, 1)
    # round robin computes 192 | 192 | 64 + 64 | 64 (ticks, split by instance): the busiest
    # instance's per tick 192 + 192 + 64 + 64 = 512, i0 320 and i1 256 over the run, mean 288
    rr = bounded.replay(reqs, 2, "round_robin", big)
    assert (rr.tick_imbalance, rr.run_imbalance) == pytest.approx((512 / 288, 320 / 288))
    # kv_aware computes all 512 uncached tokens on i0: dp, the most uneven
    kv = bounded.replay(reqs, 2, "kv_aware", big)
    assert (kv.tick_imbalance, kv.run_imbalance) == pytest.approx((2.0, 2.0))
    one = bounded.replay(reqs, 2, "one cache", big)
    assert (one.tick_imbalance, one.run_imbalance) == (1.0, 1.0)


def test_one_cache_hit_rate_grows_with_its_size_and_sizes_cover_the_curve(trace):
    reqs = bounded.kv_prompts(trace, 0, 1, 16)
    floor = bounded.min_blocks(reqs, 1)
    assert floor == 21  # 320 prompt tokens + 1 output token
    rates = [bounded.replay(reqs, 1, "one cache", b).hit_rate
             for b in range(floor, floor + 40, 4)]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    # "one cache" is one pool of dp x blocks
    assert bounded.replay(reqs, 2, "one cache", floor) == bounded.replay(
        reqs, 1, "one cache", 2 * floor)
    assert bounded.sizes(reqs, [0.5, 1.0], [5], 1) == [floor, 32, 32 + floor]
    with pytest.raises(ValueError, match="cannot admit"):
        bounded.replay(reqs, 2, "round_robin", floor - 1)

"""The router's KV index (built from instances' KV events) and the ``kv_aware`` policy: a
request goes where its prefix is cached unless that instance's load outweighs the saving; an
instance's restart (a reset batch) drops its entries; the index stays bounded."""

from __future__ import annotations

from engine.block_pool import BlockPool
from engine.prefix_hash import block_hashes, cache_salt
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.policies import KVAware, make_policy

SALT = cache_salt("tiny", "float32")
PROMPT = list(range(40))  # 10 blocks of 4


def pool_with(tokens: list[int], num_blocks: int = 16) -> BlockPool:
    """A pool that computed ``tokens`` (its full blocks registered, then freed)."""
    pool = BlockPool(num_blocks, 4, salt=SALT)
    blocks = pool.allocate(pool.blocks_needed(len(tokens)))
    pool.cache_blocks(blocks, 0, block_hashes(tokens, 4, SALT))
    pool.free(blocks)
    return pool


def test_index_follows_the_pools_events_and_restarts():
    index = KVIndex()
    a = pool_with(PROMPT[:20])
    index.apply("p0", a.take_events())
    assert index.cached_tokens(["p0", "p1"], PROMPT) == {"p0": 20, "p1": 0}
    a.free(a.allocate(16))  # every cached block evicted
    index.apply("p0", a.take_events())
    assert index.cached_tokens(["p0"], PROMPT) == {"p0": 0}
    index.apply("p0", pool_with(PROMPT[:8]).take_events())
    index.apply("p0", BlockPool(16, 4, salt=SALT).take_events())  # restarted: a new pool
    assert index.cached_tokens(["p0"], PROMPT) == {"p0": 0}


def test_index_is_bounded_per_instance():
    index = KVIndex(max_blocks=3)
    index.apply("p0", pool_with(PROMPT).take_events())
    assert len(index.get("p0").blocks) == 3


def test_kv_aware_prefers_the_cached_prefix_unless_load_outweighs_it():
    index = KVIndex()
    index.apply("p1", pool_with(PROMPT[:32]).take_events())
    policy = make_policy("kv_aware", ["p0", "p1"], index=index)
    assert isinstance(policy, KVAware)
    assert policy.order(PROMPT)[0] == "p1"
    policy.acquire("p1", 20)  # 20 tokens queued < 32 cached: still p1
    assert policy.order(PROMPT)[0] == "p1"
    policy.acquire("p1", 20)  # 40 > 32: the idle one
    assert policy.order(PROMPT)[0] == "p0"
    other = list(range(500, 540))  # nothing cached anywhere: least outstanding
    assert policy.order(other)[0] == "p0"


def test_kv_aware_without_events_rotates_like_least_outstanding():
    policy = make_policy("kv_aware", ["d0", "d1"], index=KVIndex())
    firsts = {policy.order(PROMPT)[0] for _ in range(4)}
    assert firsts == {"d0", "d1"}
    assert policy.order(PROMPT) and policy.order() != []


def test_kv_aware_preference_given_cached_lengths_is_its_order_from_the_index():
    index = KVIndex()
    index.apply("p1", pool_with(PROMPT[:32]).take_events())
    by_index = make_policy("kv_aware", ["p0", "p1"], index=index)
    given = make_policy("kv_aware", ["p0", "p1"])  # its own (empty) index is not read
    for load in (0, 20, 20):
        by_index.acquire("p1", load)
        given.acquire("p1", load)
        assert given.preference_given({"p0": 0, "p1": 32}, len(PROMPT)) == \
            by_index.order(PROMPT)
    assert given.preference_given({"p0": 0, "p1": 32}, len(PROMPT))[0] == "p0"  # 40 > 32

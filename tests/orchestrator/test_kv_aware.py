"""The router's KV index (built from instances' KV events) and the ``kv_aware`` policy: a
request goes where its prefix is cached unless that instance's load outweighs the saving; its
load there is the tokens it computes, given back exactly by the flow; an instance's restart (a
reset batch) drops its entries; the index stays bounded."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.block_pool import BlockPool
from engine.prefix_hash import block_hashes, cache_salt
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.config.schema import OrchConfig
from orchestrator.deploy.assemble import build_flow
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.policies import KVAware, make_policy
from tests.orchestrator.fakes import FakeColocated, FakeDecode, FakePrefill, Remote

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


def test_kv_aware_load_is_the_tokens_an_instance_computes_so_a_turn_stays_with_its_cache():
    index = KVIndex()
    index.apply("p1", pool_with(PROMPT[:32]).take_events())
    policy = make_policy("kv_aware", ["p0", "p1"], index=index)
    assert policy.load_for("p1", 44, PROMPT) == 44 - 32
    assert policy.load_for("p0", 44, PROMPT) == 44
    assert policy.load_for("p1", 44) == 44  # no prompt: the whole request
    # p1 computes this tick's three other turns, each cached but its last 8 tokens: 24 queued
    for _ in range(3):
        policy.acquire("p1", policy.load_for("p1", len(PROMPT), PROMPT))
    assert policy.outstanding == {"p0": 0, "p1": 24}
    assert policy.order(PROMPT)[0] == "p1"  # (40 - 32) + 24 < 40 on idle p0
    policy.acquire("p1", 9)  # 33 queued: (40 - 32) + 33 > 40
    assert policy.order(PROMPT)[0] == "p0"


def _flow(mode: str, eager: bool = False):
    cfg = OrchConfig.model_validate({"mode": mode, "cluster": {"device": "cpu"},
                                     "router": {"policy": "kv_aware", "eager_prefill": eager}})
    fakes = {"prefill-0": FakePrefill(), "decode-0": FakeDecode()} if mode != "colocated" \
        else {"colocated-0": FakeColocated()}
    return build_flow(cfg, {n: Remote(f) for n, f in fakes.items()}, lambda name: True)


@pytest.mark.parametrize("mode, computes, whole, eager", [
    ("colocated", "colocated-0", None, False), ("disaggregated", "prefill-0", "decode-0", False),
    ("disaggregated", "prefill-0", "decode-0", True)])  # eager: prefill placed before reserve
def test_kv_aware_placement_releases_exactly_the_load_it_charged(mode, computes, whole, eager):
    flow = _flow(mode, eager)
    flow.kv_index.apply(computes, pool_with(PROMPT[:32]).take_events())
    spec = RequestSpec("r1", tuple(PROMPT), SamplingParams(max_tokens=4))

    async def place():
        route = await flow.place(spec, time.monotonic() + 5.0, watch=lambda names: None)
        assert (route.prefill_call is not None) == eager
        if eager:
            await route.prefill_call
        return route

    route = asyncio.run(place())
    computing = flow.pools["prefill" if whole else "colocated"]
    tokens = spec.num_prompt_tokens if whole else spec.max_total_tokens
    assert computing.outstanding[computes] == tokens - 32  # its cached prefix not charged
    if whole:  # a decode instance carries the request's KV slots, its prompt whole
        assert flow.policy.outstanding[whole] == spec.max_total_tokens
    # the instance restarted (its cache gone): the load to give back is still the one charged
    flow.kv_index.apply(computes, BlockPool(16, 4, salt=SALT).take_events())
    assert computing.load_for(computes, tokens, PROMPT) == tokens
    flow.release(route)
    for policy in flow.pools.values():
        assert set(policy.outstanding.values()) == {0}, policy.outstanding


def test_index_counts_only_the_prefix_an_admission_may_reuse_so_the_last_token_is_load():
    # NOTE: the engine reuses at most (prompt - 1) // block_size cached blocks (its last prompt
    # token is always computed: its logits give the first token, engine/scheduler.py), so a
    # prompt cached whole still costs its instance its last block.
    index = KVIndex()
    index.apply("p1", pool_with(PROMPT).take_events())  # all 10 blocks of PROMPT cached
    assert index.cached_tokens(["p1"], PROMPT) == {"p1": 36}
    assert index.cached_tokens(["p1"], PROMPT + [7]) == {"p1": 40}  # one past: all 10 reusable
    policy = make_policy("kv_aware", ["p0", "p1"], index=index)
    assert policy.load_for("p1", len(PROMPT), PROMPT) == 4
    assert policy.load_for("p1", len(PROMPT) + 5, PROMPT) == 9  # colocated: + max_tokens

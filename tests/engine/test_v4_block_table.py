"""DeepSeek-V4 paged blocks per KV group (engine/v4/block_table.py) on the tiny V4 config:
window blocks go back as decode advances, every block is freed exactly once, and a request
never holds more than its reservation."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, NoFreeBlocksError
from engine.kv_groups import kv_groups, reservation
from engine.v4.block_table import RequestBlocks
from engine.v4.config import V4Config
from engine.v4.kv_spec import layer_specs
from orchestrator.tiny_model_v4 import tiny_v4_config_dict

BLOCK = 4


class CountingPool(BlockPool):
    """A BlockPool that counts how often each block id is handed out and returned."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.out: dict[int, int] = {}
        self.back: dict[int, int] = {}

    def allocate(self, num_blocks, hashes=()):
        block_set = super().allocate(num_blocks, hashes)
        for b in block_set.block_ids:
            self.out[b] = self.out.get(b, 0) + 1
        return block_set

    def free(self, block_set):
        super().free(block_set)
        for b in block_set.block_ids:
            self.back[b] = self.back.get(b, 0) + 1


def _setup(num_blocks: int = 64):
    config = V4Config.from_dict(tiny_v4_config_dict())
    groups = kv_groups(layer_specs(config))
    pools = {g.name: CountingPool(num_blocks, 1 if g.per == "request" else BLOCK)
             for g in groups}
    return config, groups, pools


def test_groups_cover_what_the_specs_hold():
    """Rows of a group x its row width, summed over groups, bound the specs' elements."""
    config, groups, _ = _setup()
    assert [g.name for g in groups] == [
        "window", "entries/compressed_sparse_attention", "state/compressed_sparse_attention",
        "entries/heavily_compressed_attention", "state/heavily_compressed_attention"]
    for n in (3, 16, 45):
        held = sum(s.elements(n) for s in layer_specs(config))
        window = groups[0].row_elements * min(n, config.sliding_window - 1)
        assert held <= window + sum(g.rows(n) * g.row_elements for g in groups[1:])


def test_window_blocks_freed_during_decode_each_block_once():
    """Prefill 42 tokens in 7-token chunks, decode 60: the window holds at most its
    reservation (not the context), entries grow by 1 / ratio, all blocks come back once."""
    config, groups, pools = _setup()
    sizes = {name: pool.block_size for name, pool in pools.items()}
    req, n, freed_in_decode = RequestBlocks(groups, pools), 0, 0
    for step in [7] * 6 + [1] * 60:  # chunked prefill of 42, then 60 decode steps
        req.grow(n + step)
        assert all(h <= r for h, r in zip(
            req.held().values(), reservation(groups, sizes, n + step, 7).values(), strict=True))
        n += step
        freed = req.advance(n)
        freed_in_decode += freed if step == 1 else 0
        assert req.held()["window"] <= reservation(groups, sizes, n, 1)["window"]
    held = req.held()
    assert held["entries/compressed_sparse_attention"] == -(-(102 // 4) // BLOCK)
    assert held["entries/heavily_compressed_attention"] == -(-(102 // 16) // BLOCK)
    assert held["window"] <= reservation(groups, sizes, n, 1)["window"]
    assert freed_in_decode >= (60 - BLOCK) // BLOCK
    req.free()
    for pool in pools.values():
        assert pool.num_free_blocks == pool.num_blocks and pool.num_live_sets == 0
        assert pool.out == pool.back  # every hand-out of a block id returned once
    assert sum(pools["window"].out.values()) == -(-n // BLOCK)  # each logical block once


def test_grow_takes_nothing_when_a_pool_is_short():
    """can_grow says no and grow raises without taking any block."""
    _, groups, pools = _setup(num_blocks=3)
    req = RequestBlocks(groups, pools)
    assert not req.can_grow(40)
    with pytest.raises(NoFreeBlocksError):
        req.grow(40)
    assert all(p.num_free_blocks == p.num_blocks for p in pools.values())

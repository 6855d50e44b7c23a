"""Block pool: check-then-commit, exactly-once free, slot arithmetic."""

import pytest
import torch

from engine.block_pool import BlockPool, DoubleFreeError, NoFreeBlocksError, slot_mapping
from tests.leaks import assert_pool_empty


def test_allocate_free_roundtrip_returns_every_block():
    pool = BlockPool(num_blocks=8, block_size=4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert pool.num_free_blocks == 0 and not pool.can_allocate(1)
    assert sorted(a.block_ids + b.block_ids) == list(range(8))
    pool.free(a)
    pool.free(b)
    assert_pool_empty(pool)


def test_failed_allocation_takes_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV blocks, 1 free of 4"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_double_free_is_rejected():
    pool = BlockPool(4, 4)
    s = pool.allocate(2)
    pool.free(s)
    with pytest.raises(DoubleFreeError, match="block set 0 \\(2 blocks\\) was already freed"):
        pool.free(s)
    assert_pool_empty(pool)


def test_foreign_set_is_rejected_even_when_its_set_id_is_live_here():
    pool, other = BlockPool(4, 4), BlockPool(4, 4)
    mine, theirs = pool.allocate(1), other.allocate(3)
    # NOTE: set ids count from 0 in every pool, so only the pool id tells these two apart.
    assert mine.set_id == theirs.set_id
    with pytest.raises(DoubleFreeError, match="belongs to another pool"):
        other.free(mine)
    assert other.num_free_blocks == 1 and other.num_live_sets == 1
    other.free(theirs)
    pool.free(mine)
    assert_pool_empty(other)
    assert_pool_empty(pool)


def test_truncate_gives_back_the_tail_once_and_the_old_handle_is_stale():
    """DeepSeek-V4 decode keeps its first block after the rebuild: the tail goes back at
    once (no on_free: the set lives on), the set is freed once by its new handle, the old
    handle raises."""
    pool, freed = BlockPool(4, 2), []
    pool.on_free = freed.append
    whole = pool.allocate(3)
    kept = pool.truncate(whole, 1)
    assert kept.block_ids == whole.block_ids[:1] and kept.set_id == whole.set_id
    assert pool.num_free_blocks == 3 and not freed
    with pytest.raises(DoubleFreeError):
        pool.free(whole)
    with pytest.raises(ValueError, match="keep 2 of a set of 1"):
        pool.truncate(kept, 2)
    pool.free(kept)
    assert freed == [kept]
    assert_pool_empty(pool)


def test_blocks_needed_rounds_up():
    pool = BlockPool(10, 16)
    assert [pool.blocks_needed(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_slot_mapping_follows_block_table():
    slots = slot_mapping((7, 2, 5), 3, 9, block_size=4)
    # position 3 -> block 0 offset 3; 4..7 -> block 1; 8 -> block 2
    assert slots.tolist() == [7 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0]
    assert slots.dtype == torch.int64
    with pytest.raises(ValueError, match="does not fit"):
        slot_mapping((1,), 0, 5, block_size=4)

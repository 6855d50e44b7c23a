"""The leak checks (tests/leaks.py) fail on a leak: a check that cannot fail checks nothing."""

from __future__ import annotations

import threading

import pytest

from engine.block_pool import BlockPool
from engine.request import Request, RequestSpec
from engine.sampling_params import SamplingParams
from engine.scheduler import COLOCATED, Scheduler
from rank.messages import InstanceStatusInfo
from tests.leaks import (assert_instances_idle, assert_pool_empty, assert_scheduler_empty,
                         busy_instances, kv_threads, project_threads, wait_ranks_idle,
                         wait_threads_gone)


def test_pool_with_a_live_set_or_a_missing_block_is_a_leak():
    pool = BlockPool(4, 4)
    held = pool.allocate(1)
    with pytest.raises(AssertionError, match="3 of 4 blocks free, 1 block set"):
        assert_pool_empty(pool)
    pool.free(held)
    assert_pool_empty(pool)


def test_scheduler_with_a_waiting_request_is_not_empty():
    pool = BlockPool(4, 4)
    sched = Scheduler(pool, COLOCATED, chunk_size=8, max_num_batched_tokens=8, max_num_seqs=2)
    sched.add(Request(RequestSpec("w", (1, 2), SamplingParams(max_tokens=2))))
    with pytest.raises(AssertionError, match=r"waiting \['w'\]"):
        assert_scheduler_empty(sched)
    sched.remove("w")
    assert_scheduler_empty(sched)


class _Rank:
    """The parts of a rank.rank.Rank the leak check reads: ``leader.pool``, ``role``."""

    def __init__(self, pool: BlockPool, active: int) -> None:
        self.leader = type("Leader", (), {"pool": pool})()
        self.role, self.active = self, active
        self.cfg = type("Cfg", (), {"name": "decode-0"})()

    def num_active(self) -> int:
        return self.active


def test_rank_with_an_active_request_is_not_idle():
    rank = _Rank(BlockPool(2, 4), active=1)
    with pytest.raises(AssertionError, match="decode-0: 2 of 2 blocks free, 0 block set"
                                             r"\(s\) live, 0 block\(s\) referenced, 1 request\(s\) active"):
        wait_ranks_idle(rank, timeout_s=0.05)
    rank.active = 0
    wait_ranks_idle(rank, timeout_s=0.05)


def test_instance_statuses_with_blocks_in_use_or_work_are_busy():
    idle = InstanceStatusInfo("prefill-0", "prefill", 1, free_blocks=8, total_blocks=8)
    held = InstanceStatusInfo("decode-0", "decode", 1, free_blocks=7, total_blocks=8)
    queued = InstanceStatusInfo("decode-1", "decode", 1, queue_depth=1)
    v4 = InstanceStatusInfo("decode-2", "decode", 1, kv_groups=(("window", 22, 24),
                                                                ("state/csa", 4, 4)))
    v4_idle = InstanceStatusInfo("decode-3", "decode", 1, kv_groups=(("window", 24, 24),))
    assert busy_instances([idle, held, queued, v4, v4_idle]) == [held, queued, v4]
    with pytest.raises(AssertionError, match=r"V4 group blocks held \{'window': 2\}"):
        assert_instances_idle([v4])
    assert_instances_idle([idle, v4_idle])
    with pytest.raises(AssertionError, match="decode-0: 7 of 8 blocks free"):
        assert_instances_idle([idle, held])


def test_project_threads_left_are_named():
    before = project_threads()
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=name, daemon=True)
               for name in ("kv-send-decode-0:0", "decode-0-loop", "worker-unrelated")]
    for t in threads:
        t.start()
    try:
        assert kv_threads() == ["kv-send-decode-0:0"]
        assert sorted(set(project_threads()) - set(before)) == ["decode-0-loop",
                                                                 "kv-send-decode-0:0"]
        with pytest.raises(AssertionError, match="threads left after .*decode-0-loop; "
                                                 "kv-send-decode-0:0"):
            wait_threads_gone(before, timeout_s=0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    wait_threads_gone(before, timeout_s=5)
    assert "kv-send-decode-0:0" not in kv_threads()

"""A dead or hung rank (issue 9, fault 2): prefill TP=2 on the session Ray, KV to an
in-process decode rank. A hung follower never makes ``status`` wait more than a few seconds;
a killed follower takes the instance out of service at once: every request gets an error
event within seconds, the leader keeps answering, new work is refused with a clear error and
no block leaks."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.config import InstanceConfig, ParallelConfig, SchedulerConfig
from rank.messages import Abort, Admit, InstanceOutOfService, Prefill, Reservation, Reserve
from rank.rank import Rank
from engine.request import RequestSpec
from tests.workers.test_pd_ranks import start

NUM_REQUESTS = 12
PROMPT_TOKENS = 64


class ProbedRank(Rank):
    """A rank that also says its pid and whether its loop thread lives."""

    def pid(self) -> int:
        return os.getpid()

    def loop_alive(self) -> bool:
        return self.loop is not None and self.loop.is_alive()

    def execute_step(self, steps, step_inputs=None) -> None:
        self.step_threads = {*getattr(self, "step_threads", ()),
                             threading.current_thread().name}
        super().execute_step(steps, step_inputs)

    def threads_that_stepped(self) -> set[str]:
        return getattr(self, "step_threads", set())


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=11)


@pytest.fixture
def prefill_tp2(ray_session, ckpt):
    """Leader and follower actors of prefill-0 (TP=2), started; yields (leader, follower)."""
    ray = ray_session
    cfg = InstanceConfig(
        name="prefill-0", role="prefill", checkpoint_dir=str(ckpt),
        scheduler=SchedulerConfig(block_size=4, num_kv_blocks=64, chunk_size=8,
                                  max_num_batched_tokens=8, max_num_seqs=1),
        parallel=ParallelConfig(tp=2, step_timeout_s=20),
        transfer=TransferConfig(connect_timeout_s=10, header_timeout_s=10,
                                payload_timeout_s=10, completion_timeout_s=20))
    actor = ray.remote(ProbedRank).options(num_cpus=0.1, max_concurrency=16)
    ranks = [actor.remote(cfg, rank, PrefillRole) for rank in range(2)]
    try:
        host, port = ray.get(ranks[0].open_tp_store.remote(), timeout=60)
        ray.get([r.init_rank.remote(host, port, ranks) for r in ranks], timeout=120)
        ray.get(ranks[0].start.remote(), timeout=30)
        yield ranks[0], ranks[1]
    finally:
        for r in ranks:
            ray.kill(r)


def status_in(ray, leader, bound_s: float):
    """The leader's status, asserting it came (or failed) within ``bound_s``."""
    t0 = time.monotonic()
    try:
        return ray.get(leader.status.remote(), timeout=bound_s + 5)
    finally:
        assert time.monotonic() - t0 < bound_s, f"status took {time.monotonic() - t0:.1f} s"


def test_status_answers_quickly_while_a_follower_hangs(ray_session, prefill_tp2):
    ray = ray_session
    leader, follower = prefill_tp2
    pid = ray.get(follower.pid.remote(), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError, match="rank 1 did not finish process_info within 2 s"):
            status_in(ray, leader, 4.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert status_in(ray, leader, 4.0).broken is None


def test_dead_follower_ends_every_request_and_refuses_new_work(ray_session, prefill_tp2, ckpt):
    ray = ray_session
    leader, follower = prefill_tp2
    decode = start(DecodeRole, ckpt, "decode", block_size=8, blocks=256)
    try:
        specs = [RequestSpec(f"r{i}", tuple(range(500 + i, 500 + i + PROMPT_TOKENS)),
                             SamplingParams(max_tokens=4)) for i in range(NUM_REQUESTS)]
        reservations = [decode.request(Reserve(s, 2)) for s in specs]
        assert all(isinstance(r, Reservation) for r in reservations), reservations
        ray.get([leader.request.remote(Prefill(s, r)) for s, r in zip(specs, reservations)],
                timeout=30)
        events = ray.get(leader.poll.remote(30), timeout=40)  # the first request's first token
        assert events and events[0].error is None, events
        # every step reached the follower on its step channel thread, none as a Ray call
        assert ray.get(follower.threads_that_stepped.remote()) == {"prefill-0:1-steps"}
        ray.kill(follower)
        killed = time.monotonic()
        ended = {e.request_id: e for e in events}
        while len(ended) < NUM_REQUESTS and time.monotonic() - killed < 15:
            ended.update((e.request_id, e) for e in ray.get(leader.poll.remote(0.5), timeout=10))
        took = time.monotonic() - killed
        assert len(ended) == NUM_REQUESTS and took < 10, (took, sorted(ended))
        errors = [e for e in ended.values() if e.finish_reason == "error"]
        assert errors and all("prefill-0 is out of service: rank 1 is gone" in e.error
                              for e in errors), errors

        status = status_in(ray, leader, 4.0)
        assert status.broken.startswith("rank 1 is gone") and ray.get(leader.loop_alive.remote())
        with pytest.raises(InstanceOutOfService, match="prefill-0 is out of service: rank 1 "
                                                       "is gone.*orch restarts it"):
            ray.get(leader.request.remote(Prefill(specs[0], reservations[0])), timeout=10)
        deadline = time.monotonic() + 10
        while (status.free_blocks < status.total_blocks or status.running or status.queue_depth
               ) and time.monotonic() < deadline:
            time.sleep(0.1)
            status = status_in(ray, leader, 4.0)
        assert (status.free_blocks, status.running, status.queue_depth) == (64, 0, 0), status
        for s in specs:  # the router aborts the decode side of every failed request
            decode.request(Abort(s.request_id))
        assert decode.leader.pool.num_free_blocks == 256 and decode.leader.pool.num_live_sets == 0
    finally:
        decode.shutdown()


def test_dead_decode_follower_ends_reservations_and_refuses_reserve(ray_session, ckpt):
    """Decode TP=2: once the leader learns a follower died (here from ``status``, as the
    router's status poll does), every reservation ends with an error event, its blocks are
    freed, and ``reserve``/``admit`` are refused with the clear error."""
    ray = ray_session
    cfg = InstanceConfig(
        name="decode-0", role="decode", checkpoint_dir=str(ckpt),
        scheduler=SchedulerConfig(block_size=8, num_kv_blocks=32, chunk_size=1,
                                  max_num_batched_tokens=8, max_num_seqs=4),
        parallel=ParallelConfig(tp=2, step_timeout_s=20))
    actor = ray.remote(Rank).options(num_cpus=0.1, max_concurrency=16)
    ranks = [actor.remote(cfg, rank, DecodeRole) for rank in range(2)]
    leader = ranks[0]
    try:
        host, port = ray.get(leader.open_tp_store.remote(), timeout=60)
        ray.get([r.init_rank.remote(host, port, ranks) for r in ranks], timeout=120)
        ray.get(leader.start.remote(), timeout=30)
        specs = [RequestSpec(f"d{i}", (5, 6, 7, 8), SamplingParams(max_tokens=4))
                 for i in range(3)]
        assert all(isinstance(ray.get(leader.request.remote(Reserve(s, 1)), timeout=30),
                              Reservation)
                   for s in specs)
        ray.kill(ranks[1])
        killed = time.monotonic()
        # ray.kill only asks: the follower may still answer one status before its process ends.
        broken = status_in(ray, leader, 4.0).broken
        while broken is None and time.monotonic() - killed < 10:
            time.sleep(0.2)
            broken = status_in(ray, leader, 4.0).broken
        assert broken is not None and broken.startswith("rank 1 is gone"), broken
        ended = {}
        while len(ended) < len(specs) and time.monotonic() - killed < 10:
            ended.update((e.request_id, e) for e in ray.get(leader.poll.remote(0.5), timeout=10))
        assert sorted(ended) == ["d0", "d1", "d2"], ended
        assert all(e.finish_reason == "error" and "decode-0 is out of service: rank 1 is gone"
                   in e.error for e in ended.values()), ended
        status = status_in(ray, leader, 4.0)
        assert (status.free_blocks, status.running) == (32, 0), status
        for call in (leader.request.remote(Reserve(specs[0], 1)),
                     leader.request.remote(Admit("d0", 3))):
            with pytest.raises(InstanceOutOfService, match="decode-0 is out of service"):
                ray.get(call, timeout=10)
    finally:
        for r in ranks:
            ray.kill(r)

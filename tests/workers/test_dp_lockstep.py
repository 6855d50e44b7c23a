"""DP ranks of an expert-parallel role step in lockstep (issue 11): the leaders agree on every
forward over a real Gloo group, an idle DP rank meets each forward of a busy one with an empty
forward (also each chunk re-run of a failed step), nobody runs a forward while all are idle,
and a DP rank that stops stepping breaks the others within the step bound.

Two colocated leaders (tp 1, dp 2, ep) run in threads of this process, no Ray. Their model
runner is a fake whose every forward (real or empty) is a collective over a real 2-rank Gloo
"EP" group, as the MoE all-to-alls are: a forward one DP rank runs and the other does not
would time out. The last test brings up real ranks of the tiny model with ``init_rank``."""

from __future__ import annotations

import threading
from dataclasses import replace
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from engine.sampling_params import SamplingParams
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, ParallelConfig, SchedulerConfig
from rank.dp_sync import DPGroupBroken, open_dp_sync
from rank.messages import Generate
from rank.rank import Rank
from engine.request import RequestSpec
from tests.leaks import assert_pool_empty

VOCAB, TOKEN = 32, 7  # every row's argmax is TOKEN
STEP_TIMEOUT_S = 3.0  # the sync and the fake EP collective (1.5 timed out a healthy step at load ~5)
ROUNDS_IDLE = 20
# NOTE: also how long Gloo keeps a timed-out op (and the process's exit waits for it)
CONNECT_S = 5.0


class FakeEPRunner:
    """Stands in for ``ModelRunner``: each forward all-reduces a counter over the EP group.

    ``fault``: ``(culprit, kind)``: a batch with the culprit raises; ``"after"``: a
    RuntimeError once the collective ran, ``"before"``: a ValueError before it (the runner's
    refusal of invalid steps).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.model_config = SimpleNamespace(eos_token_ids=())
        self.forwards: list[int] = []  # tokens per forward, 0 = empty forward
        self.fault: tuple[str, str] | None = None

    def _collective(self) -> None:
        work = self.group.allreduce([torch.ones(1)])
        work.wait(timedelta(seconds=STEP_TIMEOUT_S))

    def execute(self, steps: list) -> torch.Tensor:
        ids = [s.request_id for s in steps]
        faulty = self.fault is not None and self.fault[0] in ids
        if faulty and self.fault[1] == "before":
            raise ValueError(f"injected: {ids} refused")
        self._collective()
        self.forwards.append(sum(len(s.token_ids) for s in steps))
        if faulty:
            raise RuntimeError(f"injected: {ids} failed")
        logits = torch.zeros(len(steps), VOCAB)
        logits[:, TOKEN] = 1.0
        return logits

    def execute_empty(self) -> None:
        self._collective()
        self.forwards.append(0)


def _cfg(dp_rank: int) -> InstanceConfig:
    return InstanceConfig(
        name=f"colocated-{dp_rank}", role="colocated", checkpoint_dir="",
        scheduler=SchedulerConfig(block_size=4, num_kv_blocks=32, chunk_size=4,
                                  max_num_batched_tokens=16, max_num_seqs=4),
        parallel=ParallelConfig(tp=1, dp=2, dp_rank=dp_rank, ep=True,
                                step_timeout_s=STEP_TIMEOUT_S))


def _client(port: int) -> dist.TCPStore:
    # NOTE: one store client per thread: concurrent waits on one client block each other
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _join(dp_rank: int, port: int, out: list) -> None:
    """Build leader ``dp_rank``: EP group, runner, DP sync (collective: one thread each)."""
    rank = Rank(_cfg(dp_rank), 0, ColocatedRole)
    store = _client(port)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=CONNECT_S)  # rendezvous; a forward waits STEP_TIMEOUT_S
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    ep = dist.ProcessGroupGloo(dist.PrefixStore("ep", store), dp_rank, 2, opts)
    rank.runner = FakeEPRunner(ep)
    rank.dp_sync = open_dp_sync("127.0.0.1", port, dp_rank, 2, STEP_TIMEOUT_S, CONNECT_S,
                                store=_client(port))
    rank.setup_role()
    out[dp_rank] = rank


class Rounds:
    """Counts a leader's sync rounds; ``idle`` is set after ``ROUNDS_IDLE`` rounds."""

    def __init__(self, rank: Rank) -> None:
        self.count, self.idle = 0, threading.Event()
        agree = rank.dp_sync.any_work

        def counted(has_work: bool) -> bool:
            self.count += 1
            if self.count >= ROUNDS_IDLE:
                self.idle.set()
            return agree(has_work)

        rank.dp_sync.any_work = counted


@pytest.fixture
def leaders():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    ranks: list = [None, None]
    threads = [threading.Thread(target=_join, args=(i, store.port, ranks)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(ranks), "the two leaders did not build their groups"
    rounds = [Rounds(r) for r in ranks]
    for r in ranks:
        r.start()
    assert all(r.idle.wait(timeout=10) for r in rounds), "the leaders do not sync while idle"
    yield ranks
    for r in ranks:
        r.shutdown()


def _spec(rid: str, prompt_len: int, max_tokens: int) -> RequestSpec:
    return RequestSpec(rid, tuple(range(100, 100 + prompt_len)),
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _collect(rank: Rank, ids: list[str], timeout_s: float = 20.0) -> dict:
    """request id -> (tokens, finish reason, error) once each ended."""
    out = {rid: ([], None, None) for rid in ids}
    deadline = time.monotonic() + timeout_s
    while any(out[rid][1] is None for rid in ids):
        assert time.monotonic() < deadline, f"no end within {timeout_s} s: {out}"
        for ev in rank.poll(0.1):
            toks = out[ev.request_id][0] + list(ev.token_ids)
            out[ev.request_id] = (toks, ev.finish_reason, ev.error)
    return out


def _wait_idle(*ranks: Rank) -> None:
    """Until no request is active and every rank counted the same forwards (the idle one's
    last may still be returning), bounded."""
    deadline = time.monotonic() + 10
    while any(r.role.num_active() for r in ranks) or \
            len({len(r.runner.forwards) for r in ranks}) > 1:
        assert time.monotonic() < deadline, [r.runner.forwards for r in ranks]
        time.sleep(0.01)


def test_an_idle_dp_rank_meets_every_forward_of_a_busy_one(leaders):
    busy, idle = leaders
    assert busy.runner.forwards == [] and idle.runner.forwards == []  # idle rounds: no forward
    # 3 prefill chunks + 4 decode steps
    busy.request(Generate(_spec("a", prompt_len=10, max_tokens=5)))
    assert _collect(busy, ["a"]) == {"a": ([TOKEN] * 5, "length", None)}
    _wait_idle(busy, idle)
    assert busy.runner.forwards == [4, 4, 2, 1, 1, 1, 1]
    assert idle.runner.forwards == [0] * 7
    assert busy.leader.broken is None and idle.leader.broken is None


def test_both_busy_then_one_finishes(leaders):
    first, second = leaders
    first.request(Generate(_spec("long", prompt_len=3, max_tokens=6)))
    second.request(Generate(_spec("short", prompt_len=3, max_tokens=2)))
    assert _collect(first, ["long"])["long"][1] == "length"
    assert _collect(second, ["short"])["short"][1] == "length"
    _wait_idle(first, second)
    assert len(first.runner.forwards) == len(second.runner.forwards) == 6
    assert second.runner.forwards.count(0) == 4  # its request ended after 2 forwards


@pytest.mark.parametrize("kind", ["after", "before"])
def test_each_chunk_rerun_of_a_failed_step_is_met(leaders, kind):
    """A step of two requests fails on the busy rank (its collective ran, or it was refused
    before the collective); each chunk runs again alone, and the idle rank meets every
    forward: the culprit fails alone, the other request ends well."""
    busy, idle = leaders
    busy.runner.fault = ("bad", kind)
    busy.request(Generate(_spec("good", prompt_len=3, max_tokens=2)))
    busy.request(Generate(_spec("bad", prompt_len=3, max_tokens=2)))
    got = _collect(busy, ["good", "bad"])
    assert got["good"] == ([TOKEN] * 2, "length", None)
    assert got["bad"][1] == "error" and "injected" in got["bad"][2]
    _wait_idle(busy, idle)
    # both prompts (6 tokens) fail, "good" and "bad" alone, then "good"'s decode step; a
    # refused step is an empty forward on the busy rank too
    assert busy.runner.forwards == ([6, 3, 3, 1] if kind == "after" else [0, 3, 0, 1])
    assert idle.runner.forwards == [0] * 4
    assert busy.leader.broken is None and idle.leader.broken is None


def test_a_dp_rank_that_stops_stepping_breaks_the_other_within_the_bound(leaders):
    """The other leader stops syncing (out of service: it leaves no last round, unlike a
    shutdown): the busy one's next round fails within the step bound, it goes out of service,
    its request ends with a retryable error, and its loop lives on."""
    busy, gone = leaders
    gone.leader.mark_broken("injected: out of service")
    started = time.monotonic()
    busy.request(Generate(_spec("a", prompt_len=3, max_tokens=4)))
    got = _collect(busy, ["a"])
    assert time.monotonic() - started < 3 * STEP_TIMEOUT_S
    tokens, finish, error = got["a"]
    assert finish == "error" and "EP group is broken" in error, error
    assert busy.leader.broken is not None and busy.loop.is_alive()
    assert_pool_empty(busy.leader.pool)


@pytest.mark.parametrize("together", [False, True], ids=["one then the other", "together"])
def test_shutting_the_dp_ranks_down_never_waits_for_a_round_bound(leaders, together):
    """`orch up` stops an EP role's leaders together (rank_actors.stop_leaders, 5 s for all):
    a leader that stops leaves the lockstep with one last round, so the other, waiting in its
    idle round, is released at once and goes out of service (it never waits the step bound
    for a peer that will not come, which made its shutdown time out: seen once in four stops of
    configs/v4_ep_colocated.yaml at decode.tp 2)."""
    first, second = leaders
    started = time.monotonic()
    if together:
        threads = [threading.Thread(target=r.shutdown) for r in leaders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    else:
        first.shutdown()
        time.sleep(0.2)  # NOTE: the other is in an idle round that only a peer can end
        assert "stopped" in (second.leader.broken or ""), second.leader.broken
        assert "EP group is broken" in second.leader.broken
        second.shutdown()
    took = time.monotonic() - started
    assert took < STEP_TIMEOUT_S / 2, f"shutdown took {took:.2f} s"
    assert not first.loop.is_alive() and not second.loop.is_alive()


def test_a_dp_rank_lost_during_a_forward_breaks_the_group_not_the_request(leaders):
    """The other DP rank fails its empty forward (as when its ranks die): the busy rank's
    one-chunk step times out in the collective, and its re-run's round tells a broken group
    from a bad request: both go out of service, the request ends as the instance's failure."""
    busy, lost = leaders

    def gone() -> None:
        raise RuntimeError("injected: this DP rank's ranks are gone")

    lost.runner.execute_empty = gone
    busy.request(Generate(_spec("a", prompt_len=3, max_tokens=4)))
    tokens, finish, error = _collect(busy, ["a"])["a"]
    assert finish == "error" and "EP group is broken" in error, error
    assert busy.leader.broken is not None and lost.leader.broken is not None
    assert busy.loop.is_alive() and lost.loop.is_alive()


def test_the_sync_round_is_bounded():
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    syncs: list = [None, None]

    def join(i: int) -> None:
        syncs[i] = open_dp_sync("127.0.0.1", store.port, i, 2, 0.5, CONNECT_S,
                                store=_client(store.port))

    threads = [threading.Thread(target=join, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    started = time.monotonic()
    with pytest.raises(DPGroupBroken, match="failed or did not meet a step within 0.5 s"):
        syncs[0].any_work(True)  # rank 1 is alive but never asks
    assert time.monotonic() - started < 5


def test_real_ep_ranks_brought_up_by_init_rank_step_in_lockstep(tmp_path):
    """Two colocated DP ranks (dp2 x tp1, ep: 4 of the tiny model's 8 routed experts each),
    brought up as orch does (``open_ep_store``, ``init_rank`` with the EP store): a request
    on one while the other idles, then one on each, equal the tiny model on one rank."""
    from engine.runner import ModelRunner
    from orchestrator.tiny_model import write_tiny_checkpoint
    from tests.engine.engine_drive import generate_greedy

    ckpt = write_tiny_checkpoint(tmp_path / "tiny", seed=7)
    prompts = {"a": list(range(1000, 1009)), "b": list(range(1100, 1105))}
    solo = ModelRunner(ckpt, num_kv_blocks=8, block_size=16)
    want = {rid: generate_greedy(solo, p, 4, (0,))[0] for rid, p in prompts.items()}
    ranks = [Rank(replace(_cfg(i), checkpoint_dir=str(ckpt)), 0, ColocatedRole) for i in range(2)]
    host, port = ranks[0].open_ep_store()
    threads = [threading.Thread(target=r.init_rank, args=("127.0.0.1", 0, [r], (host, port)))
               for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r.runner is not None and r.dp_sync is not None for r in ranks)
    held = [sorted(map(int, r.runner.model.model.layers[1].mlp.experts)) for r in ranks]
    assert held == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for r in ranks:
        r.start()
    try:
        ranks[0].request(Generate(RequestSpec("a", tuple(prompts["a"]),
                                      SamplingParams(max_tokens=4, ignore_eos=True))))
        assert _collect(ranks[0], ["a"])["a"] == (want["a"], "length", None)
        for r, rid in zip(ranks, ("b", "a")):
            r.request(Generate(RequestSpec(rid, tuple(prompts[rid]),
                                   SamplingParams(max_tokens=4, ignore_eos=True))))
        assert _collect(ranks[0], ["b"])["b"] == (want["b"], "length", None)
        assert _collect(ranks[1], ["a"])["a"] == (want["a"], "length", None)
        assert all(r.leader.broken is None for r in ranks)
    finally:
        for r in ranks:
            r.shutdown()

"""Served steps on cpu: what a served token costs beyond the engine step, at tp 1 and tp 2.

A :class:`prefill_worker.colocated.ColocatedRank` instance of the tiny model runs as Ray
actors (tp 1, then a TP pair; its own step loop thread, the actor options ``orch up`` gives a
rank) and this process long-polls its leader for token events as the router's EventPump
does. The median gap between a request's tokens, less the bare engine decode step
(:class:`engine.runner.ModelRunner` at batch 1, timed in this process just before), is the
serving cost of one step: the leader step's scheduler, sampler and events (well under 1 ms)
and, most of it, the event path (a Ray ``poll`` call per step, its serialization, and the
rank's step loop sharing the GIL with the actor's call threads). The TP pair's gap over the
single rank's is what a TP step costs as served: the leader's step call to its follower, the
collectives, and the two ranks, this process and Ray sharing the machine's cores (on a
2-core machine far more than two idle gloo ranks' round trips).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

PROMPT = 64  # tokens of the served request's prompt
TOKENS = 24  # tokens it generates (the first 4 gaps are left out as warm-up)
FIRST_TOKENS = 9  # one-token requests timed for the time to first token
POLL_S = 0.5  # the EventPump's long-poll timeout (orchestrator/leader.py)


def _bare_decode_s(ckpt: Path, steps: int = 9) -> float:
    """Median seconds of the tiny model's batch-1 decode step at context ``PROMPT``."""
    from engine.runner import ModelRunner, SeqStep

    runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=16)
    table = tuple(range(8))
    runner.execute([SeqStep("p", tuple(range(1000, 1000 + PROMPT)), 0, table)])
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        runner.execute([SeqStep("p", (7,), PROMPT + i, table)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _token_times_s(rank, request_id: str, tokens: int = TOKENS,
                   timeout_s: float = 60.0) -> list[float]:
    """Seconds from sending ``request_id`` (``tokens`` output tokens) to the actor ``rank``
    to each of its tokens, polled as the EventPump does.

    Raises:
        TimeoutError: the request did not finish within ``timeout_s``.
        RuntimeError: it finished with an error.
    """
    import ray

    from engine.sampling_params import SamplingParams
    from prefill_worker.messages import RequestSpec

    sent = time.perf_counter()
    ray.get(rank.generate.remote(RequestSpec(
        request_id, tuple(range(1000, 1000 + PROMPT)),
        SamplingParams(max_tokens=tokens, ignore_eos=True))), timeout=30)
    arrivals, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in ray.get(rank.poll.remote(POLL_S), timeout=30):
            if ev.error:
                raise RuntimeError(f"calibration request failed: {ev.error}")
            arrivals.extend([time.perf_counter() - sent] * max(1, len(ev.token_ids)))
            if ev.finish_reason is not None:
                return arrivals
    raise TimeoutError(f"calibration request did not finish within {timeout_s} s")


def _start_instance(ckpt: Path, tp: int) -> list:
    """A started ``tp``-rank :class:`ColocatedRank` instance of ``ckpt``: its rank actors
    (leader first), made as ``orch up`` makes them, on the Ray this process runs.

    Raises:
        ray.exceptions.GetTimeoutError: a bring-up call took over 60 s.
    """
    import ray

    from orchestrator.cluster import ACTOR_CONCURRENCY
    from prefill_worker.colocated import ColocatedRank
    from prefill_worker.config import InstanceConfig, ParallelConfig, SchedulerConfig

    sched = SchedulerConfig(block_size=16, num_kv_blocks=16, chunk_size=PROMPT,
                            max_num_batched_tokens=4 * PROMPT, max_num_seqs=8)
    cfg = InstanceConfig(name=f"calib-tp{tp}", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=sched, parallel=ParallelConfig(tp=tp))
    ranks = [ray.remote(ColocatedRank).options(num_cpus=0.1, max_concurrency=ACTOR_CONCURRENCY)
             .remote(cfg, r) for r in range(tp)]
    try:
        host, port = ray.get(ranks[0].open_tp_store.remote(), timeout=60)
        ray.get([r.init_rank.remote(host, port, ranks) for r in ranks], timeout=60)
        ray.get(ranks[0].start.remote(), timeout=60)
    except BaseException:
        for rank in ranks:
            ray.kill(rank)
        raise
    return ranks


def _served_gap_s(leader, request_id: str) -> float:
    """The mean token gap, seconds, of one request served by the instance of ``leader``, as
    the poller sees it (as the bench's TPOT), its first 4 gaps left out as warm-up. NOTE: a
    mean, not a median: events polled in twos make single gaps 0 or double.

    Raises:
        see :func:`_token_times_s`.
    """
    times = _token_times_s(leader, request_id)
    return (times[-1] - times[4]) / (len(times) - 5)


def served_steps_s(ckpt: Path, rounds: int = 3) -> tuple[float, float, float, float]:
    """(bare engine decode step, served tp-1 step, served tp-2 step, served tp-1 time to
    first token), seconds: the step in this process, the token gaps of a request served by
    one rank and by a TP pair (the serving cost per step is the second less the first; what
    a TP step costs on top of that is the third less the second), and the single rank's
    first token as the poller sees it (median of ``FIRST_TOKENS`` one-token requests). Both
    instances are up together and the bare step and the two served requests timed in turn,
    ``rounds`` times (medians), so a change of load hits them alike.
    On the Ray this process runs (the caller initialises it).

    Raises:
        TimeoutError, RuntimeError: a served request did not complete (see
            :func:`_token_times_s`); ray.exceptions.GetTimeoutError: a call took over 60 s.
    """
    import ray

    instances: list[list] = []
    try:
        for tp in (1, 2):
            instances.append(_start_instance(ckpt, tp))
        times: list[list[float]] = [[], [], [], []]
        for i in range(rounds):
            times[0].append(_bare_decode_s(ckpt, steps=5))
            times[1].append(_served_gap_s(instances[0][0], f"c1-{i}"))
            times[2].append(_served_gap_s(instances[1][0], f"c2-{i}"))
        # NOTE: the first token is the noisiest figure: its own requests, one token each
        times[3] = [_token_times_s(instances[0][0], f"f-{i}", tokens=1)[0]
                    for i in range(FIRST_TOKENS)]
        bare, tp1, tp2, first = (statistics.median(t) for t in times)
        return bare, tp1, tp2, first
    finally:
        for rank in (r for ranks in instances for r in ranks):
            ray.kill(rank)

"""Served steps on cpu: what a served token costs beyond the engine step, colocated and
disaggregated.

:class:`ServedInstances` keeps two instances of the tiny model up as Ray actors, made as
``orch up`` makes them: a tp-1 :class:`prefill_worker.colocated.ColocatedRank` and a
disaggregated pair (prefill tp 1, decode tp 2, KV over gloo: configs/1p1d.yaml's layout,
brought up by :func:`orchestrator.cluster.bring_up`). This process drives them as the router
does (``generate``; or ``reserve`` on decode, ``prefill`` on prefill, ``admit`` on decode
after the first token) and long-polls the leaders for token events as the EventPump does.

- The tp-1 rank's median token gap, less the bare engine decode step
  (:class:`engine.runner.ModelRunner` at batch 1, timed in this process just before), is the
  serving cost of one step: the leader step's scheduler, sampler and events (well under
  1 ms) and, most of it, the event path (a Ray ``poll`` call per step, its serialization,
  the rank's step loop sharing the GIL with the actor's call threads).
- The decode instance's token gap over the tp-1 rank's is what a TP-2 step costs as served:
  the leader's step to its follower, the collectives, and the ranks, this process and Ray
  sharing the machine's cores.
- The time to first token of short requests, on each, sent to an in-process router: colocated from ``generate`` sent,
  disaggregated from ``reserve`` sent to the prefill's first event (the reservation, the
  receivers it arms, the prefill launch, the prefill step with its KV sends starting, the
  lone first event's way out).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

PROMPT = 64  # tokens of the served requests' prompts
TOKENS = 24  # tokens a gap request generates (the first 4 gaps are left out as warm-up)
FIRST_TOKENS = 9  # one-token requests timed for each time to first token
POLL_S = 0.5  # the EventPump's long-poll timeout (orchestrator/leader.py)
CALL_S = 30.0  # bound of one actor call


@dataclass(frozen=True)
class ServedSteps:
    """Medians, seconds, of one :meth:`ServedInstances.measure`.

    Attributes:
        bare_s: the tiny model's batch-1 decode step in this process.
        tp1_gap_s: token gap of a request served by the tp-1 colocated rank.
        tp2_gap_s: token gap of a request's decode on the pair's tp-2 decode instance.
        first_s: colocated time to first token (``generate`` sent -> first event polled).
        pd_first_s: disaggregated time to first token (``reserve`` sent -> the prefill's
            first event polled).
    """

    bare_s: float
    tp1_gap_s: float
    tp2_gap_s: float
    first_s: float
    pd_first_s: float


def _bare_decode_s(ckpt: Path, steps: int = 5) -> float:
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


def _spec(request_id: str, tokens: int):
    from engine.sampling_params import SamplingParams
    from prefill_worker.messages import RequestSpec

    return RequestSpec(request_id, tuple(range(1000, 1000 + PROMPT)),
                       SamplingParams(max_tokens=tokens, ignore_eos=True))


def _arrivals(rank, request_id: str, sent: float, first_only: bool,
              timeout_s: float = 60.0) -> tuple[list[float], int]:
    """(seconds from ``sent`` to each token of ``request_id`` that ``rank`` emits, the last
    token id), polled as the EventPump does (other requests' events, e.g. the abort of an
    earlier one-token request's reservation, are dropped), until an event ends the request
    (or, ``first_only``, until its first token).

    Raises:
        TimeoutError: no end within ``timeout_s``. RuntimeError: an error event.
    """
    import ray

    arrivals, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in ray.get(rank.poll.remote(POLL_S), timeout=CALL_S):
            if ev.request_id != request_id:
                continue
            if ev.error:
                raise RuntimeError(f"calibration request failed: {ev.error}")
            arrivals.extend([time.perf_counter() - sent] * max(1, len(ev.token_ids)))
            if ev.finish_reason is not None or (first_only and ev.token_ids):
                return arrivals, (ev.token_ids or (0,))[-1]
    raise TimeoutError(f"calibration request did not finish within {timeout_s} s")


def _colocated_times(rank, request_id: str, tokens: int) -> list[float]:
    """Seconds from ``generate`` sent to each token of a ``tokens``-token request."""
    import ray

    sent = time.perf_counter()
    ray.get(rank.generate.remote(_spec(request_id, tokens)), timeout=CALL_S)
    return _arrivals(rank, request_id, sent, first_only=False)[0]


def _pd_times(prefill, decode, request_id: str, tokens: int) -> list[float]:
    """Seconds from ``reserve`` sent to each token of a ``tokens``-token request placed as
    the router places it (reserve, prefill, then admit; a one-token request's reservation
    is aborted as the router does).

    Raises:
        RuntimeError: the reservation was refused, or an error event.
    """
    import ray

    from prefill_worker.messages import Reservation

    spec = _spec(request_id, tokens)
    sent = time.perf_counter()
    res = ray.get(decode.reserve.remote(spec, 1, 1), timeout=CALL_S)
    if not isinstance(res, Reservation):
        raise RuntimeError(f"calibration reservation refused: {res}")
    ray.get(prefill.prefill.remote(spec, res), timeout=CALL_S)
    first, token = _arrivals(prefill, request_id, sent, first_only=True)
    if tokens == 1:
        ray.get(decode.abort.remote(request_id), timeout=CALL_S)
        return first
    ray.get(decode.admit.remote(request_id, token), timeout=CALL_S)
    return first + _arrivals(decode, request_id, sent, first_only=False)[0]


def _gap_s(times: list[float]) -> float:
    """The mean token gap of one request's arrival ``times``, its first 4 gaps left out as
    warm-up. NOTE: a mean, not a median: events polled in twos make single gaps 0 or
    double."""
    return (times[-1] - times[4]) / (len(times) - 5)


def _start_colocated(ckpt: Path) -> object:
    """A started tp-1 :class:`ColocatedRank` of ``ckpt``, made as ``orch up`` makes a rank,
    on the Ray this process runs.

    Raises:
        ray.exceptions.GetTimeoutError: a bring-up call took over 60 s.
    """
    import ray

    from orchestrator.cluster import ACTOR_CONCURRENCY
    from prefill_worker.colocated import ColocatedRank
    from prefill_worker.config import InstanceConfig, ParallelConfig, SchedulerConfig

    sched = SchedulerConfig(block_size=16, num_kv_blocks=16, chunk_size=PROMPT,
                            max_num_batched_tokens=4 * PROMPT, max_num_seqs=8)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=sched, parallel=ParallelConfig(tp=1))
    rank = ray.remote(ColocatedRank).options(
        num_cpus=0.1, max_concurrency=ACTOR_CONCURRENCY).remote(cfg, 0)
    try:
        host, port = ray.get(rank.open_tp_store.remote(), timeout=60)
        ray.get(rank.init_rank.remote(host, port, [rank]), timeout=60)
        ray.get(rank.start.remote(), timeout=60)
    except BaseException:
        ray.kill(rank)
        raise
    return rank


def _config(ckpt: Path, disaggregated: bool):
    """The served instances' layout on ``ckpt``: configs/1p1d.yaml's (prefill tp 1, decode
    tp 2) or a tp-1 colocated instance; 0.1 CPU a rank, KV on loopback."""
    from orchestrator.config import OrchConfig

    blocks = {"num_kv_blocks": 16, "max_num_seqs": 8}
    prefill = {"dp": 1, "tp": 1, "chunk_size": 256, "max_num_batched_tokens": 256, **blocks} \
        if disaggregated else {"chunk_size": PROMPT, "max_num_batched_tokens": 4 * PROMPT}
    return OrchConfig.model_validate({
        "model": {"path": str(ckpt), "dtype": "float32", "max_model_len": 256},
        "mode": "disaggregated" if disaggregated else "colocated", "prefill": prefill,
        "decode": {"dp": 1, "tp": 2 if disaggregated else 1, **blocks},
        "kv_transfer": {"backend": "gloo", "block_size": 16},
        "cluster": {"device": "cpu", "cpus_per_rank": 0.1, "bind_host": "127.0.0.1"}})


def routed_first_s(cfg, handles: dict, ckpt: Path, requests: int) -> list[float]:
    """Seconds to the first token of ``requests`` two-token requests, one at a time, each
    sent to an in-process :class:`orchestrator.router.Router` of ``cfg`` over the leader
    ``handles`` (instance name -> actor) as the gRPC servicer sends it (the router's
    placement, calls and EventPump included; not gRPC nor the client). NOTE: two tokens:
    the router streams a request's last token only once its reservation is handed back, a
    one-token request's first token would wait for that call.

    Raises:
        orchestrator.request.RequestError: a request failed.
    """
    import asyncio

    from engine.sampling_params import SamplingParams
    from orchestrator.assemble import build_router
    from orchestrator.checkpoint import read_model_info
    from orchestrator.request import GenerateInput

    async def run() -> list[float]:
        router = build_router(cfg, handles, read_model_info(ckpt, "tiny",
                                                            cfg.model.max_model_len), None)
        router.start()
        times: list[float] = []
        try:
            for _ in range(requests):
                inp = GenerateInput(None, tuple(range(1000, 1000 + PROMPT)),
                                    SamplingParams(max_tokens=2, ignore_eos=True))
                sent = time.perf_counter()
                async for chunk in router.generate(inp):
                    if chunk.token_ids and len(times) < requests:
                        times.append(time.perf_counter() - sent)
        finally:
            await router.stop(drain_timeout_s=5.0)
        return times

    return asyncio.run(run())


class ServedInstances:
    """The calibration's served instances (module docstring), up from ``__enter__`` to
    ``__exit__`` on the Ray this process runs (the caller initialises it), so several
    :meth:`measure` calls (one next to each measurement they are compared with) share one
    bring-up (~5-15 s: four rank processes, each importing torch).

    Raises (``__enter__``):
        orchestrator.cluster.BringUpError, ray.exceptions.GetTimeoutError: a rank did not
            come up.
    """

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self._colocated = None
        self._pair = None
        self._count = 0

    def __enter__(self) -> "ServedInstances":
        from orchestrator.cluster import bring_up

        self._colocated = _start_colocated(self.ckpt)
        try:
            self._pair = bring_up(_config(self.ckpt, True), report=lambda *_: None)
            # NOTE: warm: the first requests connect the KV pairs and fill caches
            leaders = self._pair.leaders()
            for _ in range(2):
                _pd_times(leaders["prefill-0"], leaders["decode-0"], self._id(), 2)
                _colocated_times(self._colocated, self._id(), 2)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        import ray

        if self._pair is not None:
            self._pair.teardown(timeout_s=10)
        if self._colocated is not None:
            ray.kill(self._colocated)
        self._pair = self._colocated = None

    def measure(self, rounds: int = 3) -> ServedSteps:
        """The bare step and a request on each instance timed in turn, ``rounds`` times,
        then ``FIRST_TOKENS`` one-token requests on each in turn; medians (so a change of
        load hits them alike).

        Raises:
            TimeoutError, RuntimeError: a served request did not complete;
            ray.exceptions.GetTimeoutError: a call took over ``CALL_S``.
        """
        leaders = self._pair.leaders()
        prefill, decode = leaders["prefill-0"], leaders["decode-0"]
        times: list[list[float]] = [[], [], [], [], []]
        for _ in range(rounds):
            times[0].append(_bare_decode_s(self.ckpt))
            times[1].append(_gap_s(_colocated_times(self._colocated, self._id(), TOKENS)))
            times[2].append(_gap_s(_pd_times(prefill, decode, self._id(), TOKENS)))
        # NOTE: the first tokens are the noisiest figures: their own requests, one token each
        times[3] = routed_first_s(_config(self.ckpt, False),
                                  {"colocated-0": self._colocated}, self.ckpt, FIRST_TOKENS)
        times[4] = routed_first_s(_config(self.ckpt, True), leaders, self.ckpt, FIRST_TOKENS)
        return ServedSteps(*(statistics.median(t) for t in times))

    def _id(self) -> str:
        self._count += 1
        return f"calib-{self._count}"

"""Served steps on cpu: what a served token costs beyond the engine step, colocated and
disaggregated, as a client of the router sees it.

:class:`ServedInstances` keeps two instances of the tiny model up as Ray actors, made as
``orch up`` makes them: a tp-1 colocated :class:`rank.rank.Rank` and a
disaggregated pair (prefill tp 1, decode tp 2, KV over gloo:
configs/hetero_tp_1p1d.yaml's layout, brought up by
:func:`orchestrator.deploy.cluster.bring_up`), and one
:class:`orchestrator.router.router.Router` over each (``orchestrator.deploy.assemble.build_router``, on an
event loop thread of this process): requests go through the router's placement, its calls
and its EventPump as in ``orch up``; gRPC and the client are not on the way.

- The tp-1 rank's token gap, less the bare engine decode step
  (:class:`engine.runner.ModelRunner` at batch 1, timed in this process just before), is the
  serving cost of one step: the leader step's scheduler, sampler and events (well under
  1 ms) and, most of it, the event path (a Ray ``poll`` call per step, its serialization,
  the rank's step loop sharing the GIL with the actor's call threads).
- The decode instance's token gap over the tp-1 rank's is what a TP-2 step costs as served:
  the leader's step to its follower, the collectives, and the ranks, this process and Ray
  sharing the machine's cores.
- The time to first token of short requests on each: colocated the launch call, the prefill
  step and the lone first event's way out; disaggregated also the decode reservation (and
  the receivers it arms) before the prefill launch and the prefill rank's KV sends starting
  right after its step.

NOTE: one router per instance for the instances' whole life: a stopped router's last
``poll`` call still runs in the rank and would swallow the next router's first events.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PROMPT = 64  # tokens of the served requests' prompts
TOKENS = 24  # tokens a gap request generates (the first 4 gaps are left out as warm-up)
FIRST_TOKENS = 9  # two-token requests timed for each time to first token
CALL_S = 60.0  # bound of one served request


@dataclass(frozen=True)
class ServedSteps:
    """Medians, seconds, of one :meth:`ServedInstances.measure`, requests sent to the
    routers.

    Attributes:
        bare_s: the tiny model's batch-1 decode step in this process.
        tp1_gap_s: token gap of a request served by the tp-1 colocated rank.
        tp2_gap_s: token gap of a request's decode on the pair's tp-2 decode instance.
        first_s: colocated time to first token.
        pd_first_s: disaggregated time to first token.
    """

    bare_s: float
    tp1_gap_s: float
    tp2_gap_s: float
    first_s: float
    pd_first_s: float


def _bare_decode_s(ckpt: Path, steps: int = 9, warmup: int = 3) -> float:
    """Median seconds of the tiny model's batch-1 decode step at context ``PROMPT``, over
    ``steps`` steps after ``warmup`` untimed ones.

    NOTE: a new runner's first decode steps are slower (5.8 ms against 4.8 ms here) and five
    timed steps were few on a loaded machine: in one CI run the bare step came out above the
    served gap, the serving cost (gap - bare step, clamped at 0) 0 and the plan's colocated
    TPOT 36 % low."""
    from engine.runner import ModelRunner, SeqStep

    runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=16)
    table = tuple(range(8))
    runner.execute([SeqStep("p", tuple(range(1000, 1000 + PROMPT)), 0, table)])
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        runner.execute([SeqStep("p", (7,), PROMPT + i, table)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def _gap_s(times: list[float]) -> float:
    """The mean token gap of one request's arrival ``times``, its first 4 gaps left out as
    warm-up. NOTE: a mean, not a median: events polled in twos make single gaps 0 or
    double."""
    return (times[-1] - times[4]) / (len(times) - 5)


def _start_colocated(ckpt: Path) -> object:
    """A started tp-1 colocated :class:`Rank` of ``ckpt``, made as ``orch up`` makes a rank,
    on the Ray this process runs.

    Raises:
        ray.exceptions.GetTimeoutError: a bring-up call took over 60 s.
    """
    import ray

    from orchestrator.deploy.rank_actors import ACTOR_CONCURRENCY
    from rank.colocated import ColocatedRole
    from rank.config import InstanceConfig, ParallelConfig, SchedulerConfig
    from rank.rank import Rank

    # NOTE: prefix cache off: the same prompt is sent again and again, and the plan models
    # every prompt token computed
    sched = SchedulerConfig(block_size=16, num_kv_blocks=16, chunk_size=PROMPT,
                            max_num_batched_tokens=4 * PROMPT, max_num_seqs=8,
                            prefix_cache=False)
    cfg = InstanceConfig(name="colocated-0", role="colocated", checkpoint_dir=str(ckpt),
                         scheduler=sched, parallel=ParallelConfig(tp=1))
    rank = ray.remote(Rank).options(
        num_cpus=0.1, max_concurrency=ACTOR_CONCURRENCY).remote(cfg, 0, ColocatedRole)
    try:
        host, port = ray.get(rank.open_tp_store.remote(), timeout=60)
        ray.get(rank.init_rank.remote(host, port, [rank]), timeout=60)
        ray.get(rank.start.remote(), timeout=60)
    except BaseException:
        ray.kill(rank)
        raise
    return rank


def _config(ckpt: Path, disaggregated: bool):
    """The served instances' layout on ``ckpt``: configs/hetero_tp_1p1d.yaml's (prefill tp 1,
    decode tp 2) or a tp-1 colocated instance; 0.1 CPU a rank, KV on loopback."""
    from orchestrator.config.schema import OrchConfig

    blocks = {"num_kv_blocks": 16, "max_num_seqs": 8, "prefix_cache": False}  # as above
    prefill = {"dp": 1, "tp": 1, "chunk_size": 256, "max_num_batched_tokens": 256, **blocks} \
        if disaggregated else {"chunk_size": PROMPT, "max_num_batched_tokens": 4 * PROMPT,
                               "prefix_cache": False}
    return OrchConfig.model_validate({
        "model": {"path": str(ckpt), "dtype": "float32", "max_model_len": 256},
        "mode": "disaggregated" if disaggregated else "colocated", "prefill": prefill,
        "decode": {"dp": 1, "tp": 2 if disaggregated else 1, **blocks},
        "kv_transfer": {"backend": "gloo", "block_size": 16},
        "cluster": {"device": "cpu", "cpus_per_rank": 0.1, "bind_host": "127.0.0.1"}})


async def _token_times(router, tokens: int) -> list[float]:
    """Seconds from sending a ``tokens``-token request (``PROMPT`` prompt tokens) to
    ``router`` to each of its tokens, as the router streams them.

    Raises:
        orchestrator.router.request.RequestError: the request failed.
    """
    from engine.sampling_params import SamplingParams
    from orchestrator.router.request import GenerateInput

    inp = GenerateInput(None, tuple(range(1000, 1000 + PROMPT)),
                        SamplingParams(max_tokens=tokens, ignore_eos=True))
    sent, times = time.perf_counter(), []
    async for chunk in router.generate(inp):
        times.extend([time.perf_counter() - sent] * len(chunk.token_ids))
    return times


class ServedInstances:
    """The calibration's served instances and their routers (module docstring), up from
    ``__enter__`` to ``__exit__`` on the Ray this process runs (the caller initialises it),
    so several :meth:`measure` calls (one next to each measurement they are compared with)
    share one bring-up (~10-25 s: four rank processes, each importing torch).

    Raises (``__enter__``):
        orchestrator.deploy.rank_actors.BringUpError, ray.exceptions.GetTimeoutError: a rank did not
            come up; TimeoutError, RequestError: a warm-up request did not complete.
    """

    def __init__(self, ckpt: Path) -> None:
        self.ckpt = ckpt
        self._colocated = None
        self._pair = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._routers: dict[str, object] = {}

    def __enter__(self) -> "ServedInstances":
        from orchestrator.deploy.cluster import bring_up

        try:
            self._colocated = _start_colocated(self.ckpt)
            self._pair = bring_up(_config(self.ckpt, True), report=lambda *_: None)
            self._start_routers()
            # NOTE: warm, as measured: the first requests connect the KV pairs, fill caches
            # and run the router's code for the first time
            for name in self._routers:
                self._run(_token_times(self._routers[name], 2))
        except BaseException:
            self.__exit__()
            raise
        return self

    def _start_routers(self) -> None:
        from orchestrator.deploy.assemble import build_router
        from orchestrator.config.checkpoint import read_model_info

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="calib-router",
                                        daemon=True)
        self._thread.start()
        handles = {"colocated": {"colocated-0": self._colocated},
                   "pair": self._pair.leaders()}

        async def start(name: str):
            cfg = _config(self.ckpt, name == "pair")
            router = build_router(cfg, handles[name], read_model_info(
                self.ckpt, "tiny", cfg.model.max_model_len), None)
            router.start()
            return router

        for name in handles:
            self._routers[name] = self._run(start(name))

    def _run(self, coro):
        """Run ``coro`` on the routers' loop; its result, bounded by ``CALL_S``.

        Raises:
            TimeoutError: not done within ``CALL_S`` (it is cancelled).
        """
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=CALL_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"a calibration request took over {CALL_S:g} s") from None

    def __exit__(self, *exc) -> None:
        import ray

        for router in self._routers.values():
            try:
                self._run(router.stop(drain_timeout_s=5.0))
            except Exception:  # noqa: BLE001 - tear-down goes on
                log.exception("stopping a calibration router failed")
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        if self._pair is not None:
            self._pair.teardown(timeout_s=10)
        if self._colocated is not None:
            ray.kill(self._colocated)
        self._pair = self._colocated = self._loop = None
        self._routers = {}

    def socket_call_us(self, calls: int = 30) -> float:
        """Median round trip of a leader call over the colocated rank's call socket
        (``router.leader_calls: socket``; an ``Abort`` of an unknown request: the lock and a
        tombstone, no step), us, after a few warm-up calls.

        Raises:
            orchestrator.router.call_channel.CallConnectionLost: the connection failed;
            TimeoutError: a call took over ``CALL_S``.
        """
        from orchestrator.router.call_channel import CallChannel
        from rank.messages import Abort

        async def run() -> float:
            channel = CallChannel("colocated-0", self._colocated)
            try:
                times = []
                for i in range(5 + calls):  # NOTE: the first connect over Ray, then warm
                    t0 = time.perf_counter()
                    await channel.call(Abort("calibration-probe"))
                    if i >= 5:
                        times.append(time.perf_counter() - t0)
                return statistics.median(times) * 1e6
            finally:
                await channel.close()
        return self._run(run())

    def measure(self, rounds: int = 3) -> ServedSteps:
        """The bare step and a ``TOKENS``-token request on each instance timed in turn,
        ``rounds`` times, then ``FIRST_TOKENS`` two-token requests on each in turn (the time
        to first token: two tokens, as the router streams a request's last token only once
        a disaggregated reservation is handed back); medians (so a change of load hits them
        alike).

        Raises:
            TimeoutError, orchestrator.router.request.RequestError: a request did not complete.
        """
        times: list[list[float]] = [[], [], [], [], []]
        for _ in range(rounds):
            times[0].append(_bare_decode_s(self.ckpt))
            for i, name in ((1, "colocated"), (2, "pair")):
                times[i].append(_gap_s(self._run(_token_times(self._routers[name], TOKENS))))
        # NOTE: the first tokens are the noisiest figures: their own short requests
        for _ in range(FIRST_TOKENS):
            for i, name in ((3, "colocated"), (4, "pair")):
                times[i].append(self._run(_token_times(self._routers[name], 2))[0])
        return ServedSteps(*(statistics.median(t) for t in times))

"""The autoscaler: moves P:D toward the TTFT / TPOT targets of the ``autoscale`` section.

Every ``interval_s`` it takes :class:`Signals` (p90 TTFT and TPOT of the requests that finished
in the last ``window_s``, requests waiting for decode KV blocks, instances per role) and
:func:`decide` picks at most one step of one role:

=========================================================  ===========================
signal                                                     step
=========================================================  ===========================
waiting for decode blocks > ``max_waiting``                decode +1
TPOT p90 over its target                                   decode +1
TTFT p90 over its target                                   prefill +1
(several at once: the largest overshoot, waiting first)
every measure under ``scale_down_fraction`` x target,      the role with the most room
nothing waiting                                            under its targets -1
=========================================================  ===========================

Never outside a role's ``min``/``max``, never two steps within ``cooldown_s`` (no flapping),
latencies judged only over at least ``min_requests`` requests. Every decision is logged with
its reason and counted in the ``orch_autoscale_decisions`` metric.

The planner (``predict``: orchestrator/deploy/autoscale_plan.py) predicts TTFT and TPOT of
each candidate P:D (the counts after the step) for the workload measured in the window; the
prediction goes into the decision's reason and the ``orch_autoscale_predicted_seconds``
metric, and it chooses: among latency steps up (TTFT and TPOT both over) the one whose
predicted worst overshoot (predicted / target) is the smallest; a step down only when the
planner predicts both targets still met after it (else hold). Without a prediction (no
calibrated device, too few requests) the table alone decides.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Awaitable, Callable, Protocol

from orchestrator.config.autoscale import AutoscaleSection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Signals:
    """What one autoscaler interval sees; latencies in seconds (None: too few requests)."""

    ttft_p90: float | None
    tpot_p90: float | None
    waiting: int  # requests waiting for decode KV blocks
    counts: dict[str, int]  # role -> instances now


@dataclass(frozen=True)
class Prediction:
    """The planner's figures of one P:D (instances per role) for the measured workload."""

    prefill: int
    decode: int
    ttft_s: float
    tpot_s: float

    def text(self) -> str:
        return (f"planner: P:D {self.prefill}:{self.decode} predicts TTFT {self.ttft_s:.3g} s, "
                f"TPOT {self.tpot_s * 1e3:.3g} ms")

    def worst(self, cfg: AutoscaleSection) -> float:
        """The larger of predicted / target for TTFT and TPOT (<= 1: both met)."""
        return max(self.ttft_s / cfg.ttft_p90_s, self.tpot_s / cfg.tpot_p90_s)


@dataclass(frozen=True)
class Decision:
    """One step: ``role`` by ``delta`` (+1 / -1), and why (``kind``: "waiting", "tpot",
    "ttft" or "idle", the metric's label; ``reason``: the log line; ``prediction``: the
    planner's figures of the P:D after the step, None without)."""

    role: str
    delta: int
    kind: str
    reason: str
    prediction: Prediction | None = None


def decide(cfg: AutoscaleSection, s: Signals) -> Decision | None:
    """The step :class:`Signals` ``s`` call for under ``cfg`` (module table), or None."""
    options = candidates(cfg, s)
    return options[0] if options else None


def candidates(cfg: AutoscaleSection, s: Signals) -> list[Decision]:
    """The steps :class:`Signals` ``s`` allow under ``cfg``, the table's choice first: the
    steps up within their role's ``max`` (largest overshoot first), else the steps down
    within ``min`` (most room first), else none."""
    bounds = {"prefill": cfg.prefill, "decode": cfg.decode}
    ups: list[tuple[float, Decision]] = []
    if s.waiting > cfg.max_waiting:
        ups.append((math.inf, Decision("decode", 1, "waiting", f"{s.waiting} request(s) wait for decode "
                                                    f"KV blocks (max_waiting {cfg.max_waiting})")))
    if s.tpot_p90 is not None and s.tpot_p90 > cfg.tpot_p90_s:
        ups.append((s.tpot_p90 / cfg.tpot_p90_s, Decision(
            "decode", 1, "tpot", f"TPOT p90 {s.tpot_p90 * 1e3:.1f} ms over its target "
                         f"{cfg.tpot_p90_s * 1e3:.1f} ms")))
    if s.ttft_p90 is not None and s.ttft_p90 > cfg.ttft_p90_s:
        ups.append((s.ttft_p90 / cfg.ttft_p90_s, Decision(
            "prefill", 1, "ttft", f"TTFT p90 {s.ttft_p90:.3f} s over its target {cfg.ttft_p90_s:.3f} s")))
    if ups:
        return [up for _, up in sorted(ups, key=lambda pair: -pair[0])
                if s.counts.get(up.role, 0) < bounds[up.role].max]
    if s.waiting or s.ttft_p90 is None or s.tpot_p90 is None:
        return []  # NOTE: too few requests to judge: hold
    room = {"prefill": s.ttft_p90 / cfg.ttft_p90_s, "decode": s.tpot_p90 / cfg.tpot_p90_s}
    return [Decision(role, -1, "idle", f"{'TTFT' if role == 'prefill' else 'TPOT'} p90 at "
                                       f"{room[role]:.0%} of its target (scale down under "
                                       f"{cfg.scale_down_fraction:.0%}), nothing waits")
            for role in sorted(room, key=room.get)
            if room[role] < cfg.scale_down_fraction and s.counts.get(role, 0) > bounds[role].min]


Predict = Callable[[dict[str, int]], "Prediction | None"]


def choose(cfg: AutoscaleSection, s: Signals, predict: Predict | None) -> Decision | None:
    """The step to take: :func:`decide`'s without ``predict`` (or when it predicts nothing),
    else as the module docstring says; the chosen step carries its prediction."""
    options = candidates(cfg, s)
    if not options or predict is None:
        return options[0] if options else None
    scored = [replace(d, prediction=predict({**s.counts, d.role: s.counts[d.role] + d.delta}))
              for d in options]
    if all(d.prediction is None for d in scored):
        return options[0]
    if scored[0].delta < 0:
        met = [d for d in scored if d.prediction is None or d.prediction.worst(cfg) <= 1.0]
        if not met:
            log.info("autoscale: hold: %s; but %s", scored[0].reason,
                     "; ".join(f"{d.role} -1: {d.prediction.text()}" for d in scored))
            return None
        best = met[0]
    elif scored[0].kind == "waiting":
        best = scored[0]  # NOTE: waiting for KV blocks is decode's, whatever latencies say
    else:
        best = min(scored, key=lambda d: d.prediction.worst(cfg) if d.prediction else math.inf)
    return best if best.prediction is None else replace(
        best, reason=f"{best.reason}; {best.prediction.text()}")


class LatencyWindow:
    """TTFT / TPOT (seconds) and prompt / completion tokens of the requests that finished in
    the last ``window_s`` seconds."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        # NOTE: (at, ttft, tpot, prompt tokens, completion tokens)
        self._samples: deque[tuple[float, float, float, int, int]] = deque()

    def add(self, ttft_s: float, tpot_s: float, prompt_tokens: int = 0,
            completion_tokens: int = 0) -> None:
        self._samples.append((self.clock(), ttft_s, tpot_s, prompt_tokens, completion_tokens))

    def _recent(self) -> deque:
        cutoff = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        return self._samples

    def p90(self, min_requests: int) -> tuple[float | None, float | None]:
        """(TTFT p90, TPOT p90) over the window; None with fewer than ``min_requests``."""
        samples = self._recent()
        if len(samples) < min_requests:
            return None, None
        return _p90([x[1] for x in samples]), _p90([x[2] for x in samples])

    def shape(self, min_requests: int) -> tuple[int, int, float] | None:
        """The measured workload: (mean prompt tokens, mean completion tokens, finished
        requests per second over the window), each length at least 1; None with fewer
        than ``min_requests``."""
        samples = self._recent()
        if len(samples) < min_requests:
            return None
        n = len(samples)
        return (max(1, round(sum(x[3] for x in samples) / n)),
                max(1, round(sum(x[4] for x in samples) / n)), n / self.window_s)


def _p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile of non-empty ``values``."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)]


class WindowedMetrics:
    """The router's metrics object with every finished request's TTFT / TPOT also put in a
    :class:`LatencyWindow` (every other call goes to ``inner`` unchanged)."""

    def __init__(self, inner: object, window: LatencyWindow) -> None:
        self._inner, self.window = inner, window

    def request_finished(self, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        if ttft_s is not None and tpot_s is not None and outcome in ("stop", "length"):
            self.window.add(ttft_s, tpot_s, prompt_tokens, completion_tokens)
        self._inner.request_finished(outcome, ttft_s, tpot_s, e2e_s, prompt_tokens,
                                     completion_tokens)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class Steps(Protocol):
    """What the autoscaler changes (``orchestrator.deploy.scaling.Scaler``)."""

    async def add(self, role: str) -> str: ...

    async def remove(self, name: str) -> int: ...


class Autoscaler:
    """Runs :func:`decide` every ``cfg.interval_s`` and applies the step (router loop).

    Args:
        cfg: the ``autoscale`` section.
        signals: the :class:`Signals` now.
        steps: adds / removes instances.
        newest: role -> the instance a scale-down removes.
        record: called ``(decision)`` for every applied step (the metric).
        clock: monotonic seconds (tests pass a fake).
        predict: the planner's figures of a P:D (counts -> :class:`Prediction` or None);
            None: the decision table alone.
    """

    def __init__(self, cfg: AutoscaleSection, signals: Callable[[], Signals], steps: Steps,
                 newest: Callable[[str], str], record: Callable[[Decision], None],
                 clock: Callable[[], float] = time.monotonic,
                 predict: Predict | None = None) -> None:
        self.cfg, self.signals, self.steps = cfg, signals, steps
        self.newest, self.record, self.clock = newest, record, clock
        self.predict = predict
        self.last_change: float | None = None

    async def step(self) -> Decision | None:
        """One interval: the step taken (None: none needed, or inside the cooldown)."""
        now = self.clock()
        if self.last_change is not None and now - self.last_change < self.cfg.cooldown_s:
            return None
        decision = choose(self.cfg, self.signals(), self.predict)
        if decision is None:
            return None
        log.info("autoscale: %s %+d: %s", decision.role, decision.delta, decision.reason)
        self.record(decision)
        self.last_change = now
        try:
            if decision.delta > 0:
                await self.steps.add(decision.role)
            else:
                await self.steps.remove(self.newest(decision.role))
        except Exception as exc:  # noqa: BLE001 -- a refused step must not stop the loop
            log.warning("autoscale: %s %+d not done: %s", decision.role, decision.delta, exc)
        self.last_change = self.clock()  # NOTE: the cooldown counts from the step's end
        return decision

    async def run(self, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Forever: one :meth:`step` per interval (cancel to stop)."""
        while True:
            await sleep(self.cfg.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 -- the loop outlives any one failure
                log.exception("autoscale step failed")

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
its reason and counted in the ``orch_autoscale_decisions`` metric. The planner's prediction of
a candidate P:D is not consulted (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
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
class Decision:
    """One step: ``role`` by ``delta`` (+1 / -1), and why (``kind``: "waiting", "tpot",
    "ttft" or "idle", the metric's label; ``reason``: the log line)."""

    role: str
    delta: int
    kind: str
    reason: str


def decide(cfg: AutoscaleSection, s: Signals) -> Decision | None:
    """The step :class:`Signals` ``s`` call for under ``cfg`` (module table), or None."""
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
    for _, up in sorted(ups, key=lambda pair: -pair[0]):
        if s.counts.get(up.role, 0) < bounds[up.role].max:
            return up
    if ups or s.waiting or s.ttft_p90 is None or s.tpot_p90 is None:
        return None  # NOTE: short of a bound, or too few requests to judge: hold
    room = {"prefill": s.ttft_p90 / cfg.ttft_p90_s, "decode": s.tpot_p90 / cfg.tpot_p90_s}
    for role in sorted(room, key=room.get):
        if room[role] < cfg.scale_down_fraction and s.counts.get(role, 0) > bounds[role].min:
            return Decision(role, -1, "idle", f"{'TTFT' if role == 'prefill' else 'TPOT'} p90 at "
                                      f"{room[role]:.0%} of its target (scale down under "
                                      f"{cfg.scale_down_fraction:.0%}), nothing waits")
    return None


class LatencyWindow:
    """TTFT / TPOT of the requests that finished in the last ``window_s`` seconds."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._samples: deque[tuple[float, float, float]] = deque()  # (at, ttft, tpot)

    def add(self, ttft_s: float, tpot_s: float) -> None:
        self._samples.append((self.clock(), ttft_s, tpot_s))

    def p90(self, min_requests: int) -> tuple[float | None, float | None]:
        """(TTFT p90, TPOT p90) over the window; None with fewer than ``min_requests``."""
        cutoff = self.clock() - self.window_s
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()
        if len(self._samples) < min_requests:
            return None, None
        return (_p90([t for _, t, _ in self._samples]), _p90([t for _, _, t in self._samples]))


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
            self.window.add(ttft_s, tpot_s)
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
    """

    def __init__(self, cfg: AutoscaleSection, signals: Callable[[], Signals], steps: Steps,
                 newest: Callable[[str], str], record: Callable[[Decision], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.signals, self.steps = cfg, signals, steps
        self.newest, self.record, self.clock = newest, record, clock
        self.last_change: float | None = None

    async def step(self) -> Decision | None:
        """One interval: the step taken (None: none needed, or inside the cooldown)."""
        now = self.clock()
        if self.last_change is not None and now - self.last_change < self.cfg.cooldown_s:
            return None
        decision = decide(self.cfg, self.signals())
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

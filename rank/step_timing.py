"""Where a leader's step time goes: per-phase running sums and a small recent window.

A leader step is schedule -> fan-out to followers -> forward -> wait for the followers ->
after_step (prefill: KV send enqueue) -> sample -> emit (token events). The leader records
each phase's wall time (seconds) with :class:`StepTimer` and the whole loop iteration that
ran a forward as ``step``; ``status()`` carries a :class:`StepTimings` snapshot (plain data,
no torch/Ray: the router and the bench read it).

``other`` in a snapshot is what the step spent outside the named phases (decode's KV
completion checks, lock waits). The issue-15 figure "time outside the model forward / step
time" is :meth:`StepTimings.outside_forward_fraction`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# NOTE: order is the step's own order; reports print them in this order.
STEP_PHASES = ("schedule", "fanout", "forward", "follower_wait", "after_step", "sample", "emit")
RECENT_STEPS = 64


@dataclass(frozen=True)
class PhaseTiming:
    """One phase's record. ``total_s``: seconds summed over ``count`` records since start;
    ``recent_s``: the last (at most ``RECENT_STEPS``) records, oldest first."""

    count: int = 0
    total_s: float = 0.0
    recent_s: tuple[float, ...] = ()

    @property
    def mean_s(self) -> float:
        """Mean seconds per record since start (0.0 before the first)."""
        return self.total_s / self.count if self.count else 0.0

    @property
    def recent_mean_s(self) -> float:
        """Mean seconds over the recent window (0.0 when empty)."""
        return sum(self.recent_s) / len(self.recent_s) if self.recent_s else 0.0


@dataclass(frozen=True)
class StepTimings:
    """Snapshot of a leader's step time breakdown.

    Attributes:
        step: whole loop iterations that ran a forward (count, seconds).
        phases: phase name (one of ``STEP_PHASES``) -> its record; a phase never recorded
            is absent.
    """

    step: PhaseTiming = PhaseTiming()
    phases: dict[str, PhaseTiming] = field(default_factory=dict)

    def since(self, earlier: StepTimings) -> StepTimings:
        """What was recorded after ``earlier`` (a snapshot of the same leader); the recent
        windows are left empty. A leader restarted meanwhile reads as starting from zero."""
        if earlier.step.count > self.step.count:
            return StepTimings(_bare(self.step), {p: _bare(r) for p, r in self.phases.items()})
        return StepTimings(_minus(self.step, earlier.step),
                           {p: _minus(r, earlier.phases.get(p, PhaseTiming()))
                            for p, r in self.phases.items()})

    def mean_per_step_s(self, phase: str) -> float:
        """Seconds ``phase`` takes per step on average (sum over steps, so a phase recorded
        twice in one step counts twice; 0.0 before the first step)."""
        rec = self.phases.get(phase)
        return rec.total_s / self.step.count if rec and self.step.count else 0.0

    @property
    def other_per_step_s(self) -> float:
        """Seconds per step outside every named phase (never negative)."""
        named = sum(self.mean_per_step_s(p) for p in self.phases)
        return max(0.0, self.step.mean_s - named)

    @property
    def outside_forward_fraction(self) -> float:
        """(step time - forward time) / step time, over all steps; 0.0 before the first."""
        if not self.step.total_s:
            return 0.0
        return max(0.0, 1.0 - self.mean_per_step_s("forward") / self.step.mean_s)

    def format(self) -> str:
        """One line: mean milliseconds per step of each phase and the outside fraction."""
        if not self.step.count:
            return "no steps yet"
        parts = [f"{p} {self.mean_per_step_s(p) * 1e3:.2f}" for p in STEP_PHASES
                 if p in self.phases]
        return (f"{self.step.count} steps, {self.step.mean_s * 1e3:.2f} ms/step: "
                f"{', '.join(parts)}, other {self.other_per_step_s * 1e3:.2f} ms; outside "
                f"forward {self.outside_forward_fraction:.1%}")


def _minus(rec: PhaseTiming, earlier: PhaseTiming) -> PhaseTiming:
    return PhaseTiming(rec.count - earlier.count, rec.total_s - earlier.total_s)


def _bare(rec: PhaseTiming) -> PhaseTiming:
    return PhaseTiming(rec.count, rec.total_s)


class _Record:
    """Mutable running sum of one phase."""

    def __init__(self) -> None:
        self.count = 0
        self.total_s = 0.0
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.recent.append(seconds)

    def freeze(self) -> PhaseTiming:
        return PhaseTiming(self.count, self.total_s, tuple(self.recent))


class StepTimer:
    """Leader side recorder. The loop thread records phases (``add``/``phase``) and ends
    each iteration (``end_step``); any thread may take a :meth:`snapshot`. A lock guards the
    records (held for microseconds, never across a wait).

    NOTE: phases are held per iteration and kept only when the iteration ran a forward, so
    an idle iteration's scheduling does not count against the steps.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._step = _Record()
        self._phases: dict[str, _Record] = {}
        self._pending: list[tuple[str, float]] = []  # this iteration's records

    def add(self, phase: str, seconds: float) -> None:
        """Record ``seconds`` of ``phase`` (one of ``STEP_PHASES``) in this iteration.

        Raises:
            ValueError: ``phase`` is not a known phase.
        """
        if phase not in STEP_PHASES:
            raise ValueError(f"unknown step phase {phase!r}: use one of {STEP_PHASES}")
        with self._lock:
            self._pending.append((phase, seconds))

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Time the ``with`` body as ``phase`` (recorded even when the body raises)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0)

    def end_step(self, seconds: float) -> None:
        """The loop iteration that just ended took ``seconds``: it counts as a step, with its
        phases, when it ran a forward; else its records are dropped."""
        with self._lock:
            pending, self._pending = self._pending, []
            if not any(phase == "forward" for phase, _ in pending):
                return
            self._step.add(seconds)
            for phase, secs in pending:
                self._phases.setdefault(phase, _Record()).add(secs)

    def pending(self) -> dict[str, float]:
        """This iteration's seconds per phase so far (the loop thread, before ``end_step``)."""
        out: dict[str, float] = {}
        with self._lock:
            for phase, secs in self._pending:
                out[phase] = out.get(phase, 0.0) + secs
        return out

    def snapshot(self) -> StepTimings:
        with self._lock:
            return StepTimings(self._step.freeze(),
                               {p: r.freeze() for p, r in self._phases.items()})


# The first token's way through a leader, in order (rank clock, seconds): see FirstTokenClock.
FIRST_TOKEN_PHASES = ("queue", "forward", "step_other", "sample", "flush")
MAX_TRACKED = 4096  # requests waiting for their first token that one leader follows


class FirstTokenClock:
    """Per request, where its time went on this leader from arrival to the first token's
    frame (prefill and colocated leaders; the loop thread and actor threads call it).

    The phases (seconds, :data:`FIRST_TOKEN_PHASES`) are consecutive and cover the span
    arrival -> frame handed to the event stream:

    - ``queue``: :meth:`arrived` (enqueued) -> start of the first step that schedules it;
    - ``forward``: the forward phases (fan-out, forward, follower wait, after_step) of the
      steps that carried its chunks;
    - ``step_other``: the rest of those steps and the gaps between them (scheduling, other
      requests' chunks in between: a prompt split into several chunks waits here);
    - ``sample``: the sampling of the step that completed its prompt;
    - ``flush``: its token event emitted -> the frame holding it handed to the stream.

    They travel with the first token's event (``TokenEvent.ttft_phases``): a duration
    measured on one clock, so no clock is shared across processes.
    """

    _FORWARD = ("fanout", "forward", "follower_wait", "after_step")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: OrderedDict[str, float] = OrderedDict()
        self._run: dict[str, list[float]] = {}  # rid -> [first step start, forward, sample]

    def arrived(self, request_id: str) -> None:
        """``request_id`` was queued now (the oldest tracked is dropped past MAX_TRACKED)."""
        with self._lock:
            self._arrived[request_id] = time.perf_counter()
            while len(self._arrived) > MAX_TRACKED:
                rid, _ = self._arrived.popitem(last=False)
                self._run.pop(rid, None)

    def stepped(self, request_ids: list[str], started: float, timings: dict[str, float]
                ) -> None:
        """A step that began at ``started`` (perf_counter) carried ``request_ids``' chunks;
        ``timings``: that step's seconds per step phase (:meth:`StepTimer.pending`)."""
        fwd = sum(timings.get(p, 0.0) for p in self._FORWARD)
        with self._lock:
            for rid in request_ids:
                if rid not in self._arrived:
                    continue
                run = self._run.setdefault(rid, [started, 0.0, 0.0])
                run[1] += fwd
                run[2] = timings.get("sample", 0.0)

    def phases_at_emit(self, request_id: str) -> tuple[tuple[str, float], ...]:
        """The request's first token is emitted now: its phases so far, ``flush`` 0 (set
        by :meth:`flushed`); () for a request not followed (or no longer)."""
        now = time.perf_counter()
        with self._lock:
            arrived = self._arrived.pop(request_id, None)
            run = self._run.pop(request_id, None)
        if arrived is None or run is None:
            return ()
        first, fwd, smp = run
        other = max(0.0, now - first - fwd - smp)
        return (("queue", first - arrived), ("forward", fwd), ("step_other", other),
                ("sample", smp), ("flush", now))

    def forget(self, request_id: str) -> None:
        """The request left before its first token (abort, error)."""
        with self._lock:
            self._arrived.pop(request_id, None)
            self._run.pop(request_id, None)


def with_flush(phases: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    """``phases`` from :meth:`FirstTokenClock.phases_at_emit` with ``flush`` turned from the
    emit time into the seconds until now (the frame is handed to the stream)."""
    now = time.perf_counter()
    return tuple((p, now - s) if p == "flush" else (p, s) for p, s in phases)

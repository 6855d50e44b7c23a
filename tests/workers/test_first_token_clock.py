"""rank/step_timing.py's FirstTokenClock: a request's phases on a leader are consecutive and
cover arrival -> its first token's frame (issue 36, TTFT breakdown)."""

from __future__ import annotations

import time

import pytest

from rank.step_timing import FIRST_TOKEN_PHASES, FirstTokenClock, with_flush


def test_phases_cover_arrival_to_flush_in_order():
    clock = FirstTokenClock()
    t0 = time.perf_counter()
    clock.arrived("a")
    time.sleep(0.01)  # queued
    first = time.perf_counter()
    clock.stepped(["a", "unknown"], first, {"forward": 0.004, "fanout": 0.001, "sample": 0.5})
    clock.stepped(["a"], first + 0.02, {"forward": 0.003, "sample": 0.002, "schedule": 0.001})
    time.sleep(0.03)
    phases = clock.phases_at_emit("a")
    time.sleep(0.005)
    phases = dict(with_flush(phases))
    total = time.perf_counter() - t0
    assert tuple(phases) == FIRST_TOKEN_PHASES
    assert phases["queue"] == pytest.approx(first - t0, abs=1e-3) and phases["queue"] >= 0.009
    assert phases["forward"] == pytest.approx(0.008)  # both steps' forward + fan-out
    assert phases["sample"] == pytest.approx(0.002)  # the step that completed the prompt
    assert phases["flush"] >= 0.005
    assert sum(phases.values()) == pytest.approx(total, abs=1e-3)
    assert clock.phases_at_emit("a") == ()  # once per request
    assert clock.phases_at_emit("unknown") == ()


def test_forgotten_and_untracked_requests_give_nothing():
    clock = FirstTokenClock()
    clock.arrived("b")
    clock.stepped(["b"], time.perf_counter(), {"forward": 0.001})
    clock.forget("b")
    assert clock.phases_at_emit("b") == ()
    clock.arrived("c")  # never stepped (aborted while queued)
    assert clock.phases_at_emit("c") == ()

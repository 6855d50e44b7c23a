"""The autoscaler on a fake clock and a fake system: a load step adds decode within two
intervals and the drop removes it again; never outside min/max; never two steps within the
cooldown; the decision table's priorities; the latency window's p90."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.config.autoscale import AutoscaleSection
from orchestrator.deploy.autoscaler import (Autoscaler, LatencyWindow, Prediction, Signals,
                                           choose, decide)

INTERVAL_S = 10.0


def section(**kw) -> AutoscaleSection:
    base = dict(ttft_p90_s=1.0, tpot_p90_s=0.05, interval_s=INTERVAL_S, cooldown_s=30.0,
                prefill={"min": 1, "max": 2}, decode={"min": 1, "max": 3})
    return AutoscaleSection.model_validate({**base, **kw})


class FakeSystem:
    """Latencies that grow with load per instance: TPOT = 20 ms x load / decode instances,
    TTFT = 0.2 s x load / prefill instances; every step applied at once."""

    def __init__(self) -> None:
        self.now = 0.0
        self.load = 1.0
        self.counts = {"prefill": 1, "decode": 1}
        self.changes: list[tuple[float, str, int]] = []  # (time, role, delta)
        self.seen: list[dict[str, int]] = []

    def signals(self) -> Signals:
        self.seen.append(dict(self.counts))
        return Signals(ttft_p90=0.2 * self.load / self.counts["prefill"],
                       tpot_p90=0.02 * self.load / self.counts["decode"], waiting=0,
                       counts=dict(self.counts))

    async def add(self, role: str) -> str:
        self.counts[role] += 1
        self.changes.append((self.now, role, 1))
        return f"{role}-{self.counts[role] - 1}"

    async def remove(self, name: str) -> int:
        role = name.rsplit("-", 1)[0]
        self.counts[role] -= 1
        self.changes.append((self.now, role, -1))
        return 0


def run(system: FakeSystem, cfg: AutoscaleSection, loads: list[float]) -> list:
    """One autoscaler step per interval, the fake system's load ``loads[i]`` in interval i."""
    scaler = Autoscaler(cfg, system.signals, system, lambda role: f"{role}-x",
                        record=lambda d: None, clock=lambda: system.now)
    out = []
    for load in loads:
        system.now += INTERVAL_S
        system.load = load
        out.append(asyncio.run(scaler.step()))
    return out


def test_a_load_step_adds_decode_within_two_intervals_and_removes_it_after():
    system = FakeSystem()
    cfg = section()
    loads = [1.0] * 4 + [4.0] * 6 + [1.0] * 8  # 4x the rate for a minute
    decisions = run(system, cfg, loads)
    step_at = 4 * INTERVAL_S + INTERVAL_S  # the time of the first interval under 4x
    adds = [t for t, role, d in system.changes if role == "decode" and d == 1]
    removes = [t for t, role, d in system.changes if role == "decode" and d == -1]
    assert adds and adds[0] <= step_at + INTERVAL_S, system.changes
    assert removes and removes[-1] > 10 * INTERVAL_S, system.changes
    assert system.counts == {"prefill": 1, "decode": 1}
    assert [d.kind for d in decisions if d] == ["tpot", "idle"]
    assert "TPOT p90 80.0 ms over its target 50.0 ms" in next(d for d in decisions if d).reason


def test_never_beyond_min_and_max():
    system = FakeSystem()
    run(system, section(cooldown_s=0.0), [50.0] * 10 + [0.01] * 10)
    assert all(1 <= seen["decode"] <= 3 and 1 <= seen["prefill"] <= 2 for seen in system.seen)
    assert max(s["decode"] for s in system.seen) == 3
    assert max(s["prefill"] for s in system.seen) == 2
    assert system.counts == {"prefill": 1, "decode": 1}


def test_no_two_steps_inside_the_cooldown():
    system = FakeSystem()
    cfg = section(cooldown_s=35.0)
    run(system, cfg, [4.0, 0.1, 4.0, 0.1] * 6)  # load flips every interval
    times = [t for t, _, _ in system.changes]
    assert len(times) >= 2
    assert all(b - a >= cfg.cooldown_s for a, b in zip(times, times[1:])), system.changes


@pytest.mark.parametrize("signals, step", [
    (Signals(5.0, 0.5, 3, {"prefill": 1, "decode": 1}), ("decode", 1, "waiting")),
    (Signals(5.0, 0.06, 0, {"prefill": 1, "decode": 1}), ("prefill", 1, "ttft")),
    (Signals(5.0, 0.5, 0, {"prefill": 1, "decode": 1}), ("decode", 1, "tpot")),
    (Signals(5.0, 0.5, 0, {"prefill": 1, "decode": 3}), ("prefill", 1, "ttft")),  # at max
    (Signals(5.0, 0.5, 0, {"prefill": 2, "decode": 3}), None),  # both at max
    (Signals(None, None, 0, {"prefill": 2, "decode": 3}), None),  # too few to judge
    (Signals(0.1, 0.04, 0, {"prefill": 2, "decode": 3}), ("prefill", -1, "idle")),
    (Signals(0.6, 0.01, 0, {"prefill": 2, "decode": 3}), ("decode", -1, "idle")),
    (Signals(0.1, 0.01, 1, {"prefill": 2, "decode": 3}), None),  # something waits: hold
])
def test_decision_table(signals, step):
    got = decide(section(), signals)
    assert (got.role, got.delta, got.kind) == step if step else got is None


def test_latency_window_p90_over_the_window_only():
    now = [0.0]
    window = LatencyWindow(30.0, clock=lambda: now[0])
    for i in range(10):
        window.add(100.0, 100.0)  # all left the window below
    now[0] = 31.0
    for i in range(1, 11):
        window.add(i * 0.1, i * 0.01)
    assert window.p90(min_requests=5) == pytest.approx((0.9, 0.09))
    assert window.p90(min_requests=11) == (None, None)


def _table(predictions: dict[tuple[int, int], tuple[float, float]]):
    """A planner stand-in: P:D -> (TTFT s, TPOT s), hand-made; every call recorded."""
    asked = []

    def predict(counts):
        asked.append((counts["prefill"], counts["decode"]))
        key = (counts["prefill"], counts["decode"])
        return Prediction(*key, *predictions[key]) if key in predictions else None
    return predict, asked


def test_the_planner_picks_the_step_up_with_the_smaller_predicted_overshoot():
    # TTFT 1.5x over (prefill +1 first by the table), TPOT 1.2x over
    signals = Signals(1.5, 0.06, 0, {"prefill": 1, "decode": 1})
    predict, asked = _table({(2, 1): (0.8, 0.09), (1, 2): (1.1, 0.03)})
    got = choose(section(), signals, predict)
    assert decide(section(), signals).role == "prefill"
    assert sorted(asked) == [(1, 2), (2, 1)]
    assert (got.role, got.delta, got.kind) == ("decode", 1, "tpot")
    assert got.prediction == Prediction(1, 2, 1.1, 0.03)
    assert got.reason == ("TPOT p90 60.0 ms over its target 50.0 ms; planner: P:D 1:2 "
                          "predicts TTFT 1.1 s, TPOT 30 ms")


def test_the_planner_holds_a_step_down_that_would_miss_a_target():
    signals = Signals(0.3, 0.01, 0, {"prefill": 2, "decode": 2})  # both under half the target
    table = {(2, 1): (0.4, 0.07), (1, 2): (1.4, 0.01)}  # either step down misses a target
    assert choose(section(), signals, _table(table)[0]) is None
    table[(2, 1)] = (0.4, 0.04)
    got = choose(section(), signals, _table(table)[0])
    assert (got.role, got.delta) == ("decode", -1)
    assert got.reason.endswith("planner: P:D 2:1 predicts TTFT 0.4 s, TPOT 40 ms")


def test_without_a_prediction_the_table_decides_and_waiting_stays_first():
    signals = Signals(1.5, 0.06, 0, {"prefill": 1, "decode": 1})
    assert choose(section(), signals, _table({})[0]) == decide(section(), signals)
    waiting = Signals(1.5, 0.06, 2, {"prefill": 1, "decode": 1})
    predict, _ = _table({(2, 1): (0.5, 0.01), (1, 2): (1.4, 0.06)})
    assert choose(section(), waiting, predict).kind == "waiting"


def test_the_step_logs_and_records_the_prediction(caplog):
    system = FakeSystem()
    system.load = 3.0  # TPOT 60 ms over 50, TTFT 0.6 s under 1 s
    recorded = []
    predict, _ = _table({(1, 2): (0.6, 0.03)})
    scaler = Autoscaler(section(), system.signals, system, lambda role: f"{role}-x",
                        record=recorded.append, clock=lambda: system.now, predict=predict)
    with caplog.at_level("INFO", logger="orchestrator.deploy.autoscaler"):
        asyncio.run(scaler.step())
    assert system.counts == {"prefill": 1, "decode": 2}
    assert recorded[0].prediction == Prediction(1, 2, 0.6, 0.03)
    assert "decode +1: TPOT p90 60.0 ms over its target 50.0 ms; planner: P:D 1:2 predicts " \
           "TTFT 0.6 s, TPOT 30 ms" in caplog.text


def test_latency_window_shape_is_the_measured_workload():
    now = [0.0]
    window = LatencyWindow(20.0, clock=lambda: now[0])
    for prompt, completion in ((100, 10), (300, 30)):
        window.add(0.1, 0.01, prompt, completion)
    assert window.shape(min_requests=2) == (200, 20, pytest.approx(0.1))
    assert window.shape(min_requests=3) is None

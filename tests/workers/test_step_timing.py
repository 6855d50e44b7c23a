"""The step time breakdown (rank/step_timing.py): an iteration's phases count only
when it ran a forward, per-step means and the outside-forward fraction follow from the sums;
and a real colocated leader (TP=1, in-process) reports every phase of its decode steps in
``status()``."""

from __future__ import annotations

import time

import pytest
import torch

from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from orchestrator.api.convert import status_from_proto, status_to_proto
from orchestrator.metrics import RouterMetrics
from orchestrator.status import InstanceView
from rank.colocated import ColocatedRole
from rank.messages import Generate, InstanceStatusInfo
from engine.request import RequestSpec
from rank.step_timing import STEP_PHASES, StepTimer
from tests.workers.test_pd_ranks import start


def test_idle_iterations_do_not_count_and_fractions_follow_the_sums():
    timer = StepTimer()
    timer.add("schedule", 0.5)  # an idle iteration: scheduled nothing, no forward
    timer.end_step(0.5)
    for forward in (0.06, 0.08):
        timer.add("schedule", 0.01)
        timer.add("forward", forward)
        timer.add("emit", 0.005)
        timer.end_step(0.1)
    snap = timer.snapshot()
    assert snap.step.count == 2 and snap.step.total_s == pytest.approx(0.2)
    assert snap.mean_per_step_s("schedule") == pytest.approx(0.01)
    assert snap.mean_per_step_s("forward") == pytest.approx(0.07)
    assert snap.other_per_step_s == pytest.approx(0.1 - 0.07 - 0.01 - 0.005)
    assert snap.outside_forward_fraction == pytest.approx(0.3)
    assert snap.phases["forward"].recent_s == pytest.approx((0.06, 0.08))
    assert "2 steps" in snap.format() and "outside forward 30.0%" in snap.format()
    with pytest.raises(ValueError, match="unknown step phase 'nap'"):
        timer.add("nap", 1.0)


def test_metrics_export_each_phase_per_instance():
    timer = StepTimer()
    for _ in range(3):
        timer.add("forward", 0.09)
        timer.add("sample", 0.01)
        timer.end_step(0.1)
    metrics = RouterMetrics()
    metrics.update_instances([InstanceStatusInfo("decode-0", "decode", 1,
                                                 step_timings=timer.snapshot())])
    value = metrics.registry.get_sample_value
    labels = {"instance": "decode-0", "phase": "forward"}
    assert value("orch_step_phase_seconds_count", labels) == 3
    assert value("orch_step_phase_seconds_sum", labels) == pytest.approx(0.27)
    assert value("orch_step_phase_seconds_count", {"instance": "decode-0", "phase": "step"}) == 3
    assert value("orch_step_outside_forward_ratio", {"instance": "decode-0"}) == pytest.approx(0.1)


def test_timings_travel_through_get_status_and_subtract_per_run():
    timer = StepTimer()
    timer.add("forward", 0.08)
    timer.end_step(0.1)
    before = timer.snapshot()
    for _ in range(2):
        timer.add("forward", 0.05)
        timer.add("fanout", 0.002)
        timer.end_step(0.06)
    status = InstanceStatusInfo("decode-0", "decode", 2, step_timings=timer.snapshot())
    view = InstanceView("decode-0", "decode", 2, "healthy", "", status)
    (back,) = status_from_proto(status_to_proto([view], 0, "tiny"))
    after = back.status.step_timings
    assert after.step.count == 3 and after.phases["fanout"].count == 2
    run = after.since(before)
    assert run.step.count == 2 and run.step.total_s == pytest.approx(0.12)
    assert run.mean_per_step_s("forward") == pytest.approx(0.05)
    assert run.mean_per_step_s("fanout") == pytest.approx(0.002)
    assert before.since(after).step.count == 1  # a restarted leader: counted from zero


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


def test_colocated_leader_reports_its_step_breakdown(ckpt):
    rank = start(ColocatedRole, ckpt, "colocated", block_size=8, blocks=64)
    try:
        for i in range(2):
            rank.request(Generate(RequestSpec(f"t{i}", tuple(range(100 + i, 110 + i)),
                                      SamplingParams(max_tokens=6, ignore_eos=True))))
        deadline = time.monotonic() + 30
        ended = set()
        while len(ended) < 2:
            assert time.monotonic() < deadline, ended
            ended |= {e.request_id for e in rank.poll(0.1) if e.finish_reason}
        snap = rank.status().step_timings
    finally:
        rank.shutdown()
    # TP=1: no followers, so no fan-out or follower wait
    assert set(snap.phases) == set(STEP_PHASES) - {"fanout", "follower_wait"}
    assert snap.step.count >= 6 and snap.phases["forward"].count >= snap.step.count
    assert 0.0 < snap.outside_forward_fraction < 1.0
    assert snap.step.mean_s >= snap.mean_per_step_s("forward") > 0

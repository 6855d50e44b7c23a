"""The autoscaler's planner predictions (orchestrator/deploy/autoscale_plan.py): the P:D
asked for planned on the workload measured in the window, as `orch plan` plans it."""

from __future__ import annotations

import pytest

from orchestrator.config.load import load_config
from orchestrator.deploy.autoscale_plan import PlannerPredictor
from orchestrator.deploy.autoscaler import LatencyWindow
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.report import plan_config
from orchestrator.planner.specs import default_device
from tests.e2e.harness import REPO


@pytest.fixture
def predictor():
    cfg = load_config(REPO / "configs" / "1p1d.yaml")
    window = LatencyWindow(10.0, clock=lambda: 0.0)
    return cfg, window, PlannerPredictor(cfg, window, default_device("cuda"), min_requests=2)


def test_a_candidate_is_planned_on_the_measured_workload(predictor):
    cfg, window, predict = predictor
    assert predict({"prefill": 1, "decode": 1}) is None  # nothing measured yet
    for prompt, completion in ((60, 20), (100, 40)):  # 2 requests in 10 s: 0.2 req/s
        window.add(0.5, 0.05, prompt, completion)
    assert predict.workload() == WorkloadSpec(80, 30, rate=pytest.approx(0.2))
    got = predict({"prefill": 2, "decode": 3})
    sized = cfg.model_copy(update={"prefill": cfg.prefill.model_copy(update={"dp": 2}),
                                   "decode": cfg.decode.model_copy(update={"dp": 3})})
    point = plan_config(sized, WorkloadSpec(80, 30, rate=0.2), default_device("cuda")).point
    assert (got.prefill, got.decode) == (2, 3)
    assert (got.ttft_s, got.tpot_s) == pytest.approx((point.ttft_s, point.tpot_s))
    assert 0 < got.ttft_s < 10 and 0 < got.tpot_s < 1


def test_no_device_or_an_unplannable_workload_predicts_nothing(predictor):
    cfg, window, predict = predictor
    window.add(0.5, 0.05, 10_000, 10)  # longer than model.max_model_len
    window.add(0.5, 0.05, 10_000, 10)
    assert predict({"prefill": 1, "decode": 1}) is None
    assert PlannerPredictor(cfg, window, None)({"prefill": 1, "decode": 1}) is None

"""`orch plan` on this CPU machine predicts what `orch bench` measures (issue 17): for
configs/colocated.yaml and configs/1p1d.yaml, median TTFT and TPOT within 30 % (64-token
prompts, 16 output tokens, one request in flight).

The only timing assertion of the suite (the issue asks for it), so made as steady as it can
be on a shared, timing-noisy 2-core machine: each config is brought up once (on the session's
Ray) and warmed (2 requests); the cpu device is measured in this process right then, with the
deployment up, on its own tiny checkpoint and the session's Ray; the measurement is the
median of three benches' medians (4 requests each, ``orch bench`` in a subprocess).
"""

from __future__ import annotations

import os

import pytest

from orchestrator.checkpoint import ensure_checkpoint
from orchestrator.config import load_config
from orchestrator.planner.calibrate import measure_cpu
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.versus import bench_ms, compare
from tests.e2e.harness import REPO, OrchProcess

WORKLOAD = WorkloadSpec(64, 16, concurrency=1)
REPS, REQUESTS = 3, 4


def test_plan_predicts_bench_within_30_percent(tmp_path, ray_session):
    ckpt = ensure_checkpoint(load_config(REPO / "configs" / "1p1d.yaml").model)
    overrides = {"cluster.address": ray_session.get_runtime_context().gcs_address,
                 "cluster.bind_host": "127.0.0.1"}
    rows, figures = [], []
    for name in ("colocated", "1p1d"):
        path = REPO / "configs" / f"{name}.yaml"
        with OrchProcess(path, tmp_path, overrides) as orch:
            bench_ms(orch.address, WORKLOAD, 1, warmup=2)
            # NOTE: measured with the deployment up and warm, right before its benches: the
            # load of a shared machine moves the cpu figures within a minute
            device = measure_cpu(ckpt)
            figures.append(f"{name}: " + ", ".join(
                f"{k[:-3]} {getattr(device, k) / 1e3:.2f}" for k in (
                    "layer_overhead_us", "step_serving_us", "first_token_us",
                    "link_latency_us", "control_call_us")))
            rows += compare(name, load_config(path), orch.address, device, WORKLOAD, REPS,
                            REQUESTS)
    text = "; ".join(map(str, rows)) + f" (load average {os.getloadavg()[0]:.1f} on " \
        f"{os.cpu_count()} cores; cpu figures in ms: {'; '.join(figures)})"
    print(text)
    for row in rows:
        assert row.predicted_ms == pytest.approx(row.measured_ms, rel=0.3), text

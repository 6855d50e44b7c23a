"""`orch plan` on this CPU machine predicts what `orch bench` measures: configs/1p1d.yaml and
configs/colocated.yaml, one small workload (64-token prompts, 16 output tokens, one request
in flight, 4 timed), median TTFT and TPOT each within 30 %. The cpu device is measured once,
just before the bench, so both see the same load on a shared machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from orchestrator.config import load_config
from orchestrator.planner.calibrate import measure_cpu
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.report import plan_config
from tests.e2e.harness import REPO

CONFIGS = ("colocated", "1p1d")
IN, OUT = 64, 16


def test_plan_predicts_bench_within_30_percent(tmp_path, ray_session):
    # NOTE: ray_session: the calibration's Ray call round trip runs on the session's Ray
    device = measure_cpu()
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "bench", "--up",
         *(str(REPO / "configs" / f"{c}.yaml") for c in CONFIGS), "--up-out", str(out),
         "--workload", "synthetic", "--num-requests", "4", "--warmup", "1", "--input-len",
         str(IN), "--output-len", str(OUT), "--max-concurrency", "1", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    wl = WorkloadSpec(IN, OUT, concurrency=1)
    rows = []
    for name in CONFIGS:
        report = json.loads((out / f"{name}.json").read_text())
        point = plan_config(load_config(REPO / "configs" / f"{name}.yaml"), wl, device).point
        rows.append((name, "TTFT", point.ttft_s * 1e3, report["ttft"]["p50_ms"]))
        rows.append((name, "TPOT", point.tpot_s * 1e3, report["tpot"]["p50_ms"]))
    text = "; ".join(f"{n} {k}: plan {p:.1f} ms, bench {b:.1f} ms" for n, k, p, b in rows) \
        + f" (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)"
    print(text)
    for name, kind, predicted, measured in rows:
        assert predicted == pytest.approx(measured, rel=0.3), text

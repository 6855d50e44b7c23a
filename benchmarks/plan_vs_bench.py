"""`orch plan` vs `orch bench` on this CPU machine: configs/colocated.yaml and configs/1p1d.yaml,
one small workload (64-token prompts, 16 output tokens, one request in flight, one warm-up,
4 timed). Measures the cpu device once just before the bench (so both see about the same
load), then prints each config's predicted and measured median TTFT / TPOT and the error.
Not a test: on a shared 2-core machine the error depends on how the load moves between the
calibration and the bench (docs/planner.md). Run (~45-60 s):
``PYTHONPATH=. python benchmarks/plan_vs_bench.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from orchestrator.config import load_config
from orchestrator.planner.calibrate import measure_cpu
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.report import plan_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("colocated", "1p1d")
IN, OUT, REQUESTS = 64, 16, 4


def run_bench(out: Path) -> None:
    """``orch bench --up`` of both configs, reports as ``out/<config>.json``.

    Raises:
        RuntimeError: the bench failed (its output's tail in the message).
    """
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "bench", "--up",
         *(str(REPO / "configs" / f"{c}.yaml") for c in CONFIGS), "--up-out", str(out),
         "--workload", "synthetic", "--num-requests", str(REQUESTS), "--warmup", "1",
         "--input-len", str(IN), "--output-len", str(OUT), "--max-concurrency", "1",
         "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError("orch bench failed: " + done.stdout[-2000:] + done.stderr[-2000:])


def main() -> None:
    load_before = os.getloadavg()[0]
    device = measure_cpu()
    print(f"cpu: serving cost per step {device.step_serving_us / 1e3:.2f} ms, host "
          f"{device.layer_overhead_us / 1e3:.2f} ms per layer, collective "
          f"{device.link_latency_us / 1e3:.2f} ms, Ray call {device.control_call_us / 1e3:.2f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        run_bench(Path(tmp))
        reports = {c: json.loads((Path(tmp) / f"{c}.json").read_text()) for c in CONFIGS}
    wl = WorkloadSpec(IN, OUT, concurrency=1)
    for name in CONFIGS:
        point = plan_config(load_config(REPO / "configs" / f"{name}.yaml"), wl, device).point
        for kind, predicted in (("ttft", point.ttft_s * 1e3), ("tpot", point.tpot_s * 1e3)):
            measured = reports[name][kind]["p50_ms"]
            print(f"{name:10s} {kind.upper()}: plan {predicted:6.1f} ms, bench {measured:6.1f} ms,"
                  f" error {(predicted - measured) / measured:+.0%}")
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()

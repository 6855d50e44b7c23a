"""`orch plan` vs `orch bench` on this CPU machine (issue 17's check; in CI as
tests/e2e/test_plan_vs_bench.py), with ``--reps`` and, with ``--concurrency 1 4``, a loaded
closed loop (planned in lock-step, ``start=together``, as the bench runs equal requests):
for configs/colocated.yaml and configs/hetero_tp_1p1d.yaml (64-token prompts, 16 output tokens),
the predicted and measured median TTFT / TPOT and the error
(orchestrator/planner/versus.py). Starts its own Ray; the calibration's served instances are
brought up once on it, each config once; the cpu device is measured with the config up,
right before its benches. Run (~1-2 min):
``PYTHONPATH=. python benchmarks/plan_vs_bench.py [--reps 5] [--concurrency 1 4]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import ray

from orchestrator.config.checkpoint import ensure_checkpoint
from orchestrator.config.load import load_config
from orchestrator.planner.calibrate import measure_cpu
from orchestrator.planner.calibrate_serving import ServedInstances
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.versus import bench_ms, compare
from tests.e2e.harness import OrchProcess

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("colocated", "hetero_tp_1p1d")  # NOTE: the planner calibrates a P1 -> D2 pair
IN, OUT, REQUESTS = 64, 16, 4


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5, help="reps per config and load")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1],
                   help="requests in flight (closed loop), one comparison each")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}})
    try:
        ckpt = ensure_checkpoint(load_config(REPO / "configs" / "hetero_tp_1p1d.yaml").model)
        overrides = {"cluster.address": ray.get_runtime_context().gcs_address,
                     "cluster.bind_host": "127.0.0.1"}
        with tempfile.TemporaryDirectory() as tmp, ServedInstances(ckpt) as served:
            for name in CONFIGS:
                path = REPO / "configs" / f"{name}.yaml"
                with OrchProcess(path, Path(tmp), overrides) as orch:
                    bench_ms(orch.address, WorkloadSpec(IN, OUT, concurrency=1), 1, warmup=2)
                    device = measure_cpu(ckpt, served)  # NOTE: with it up, just before
                    print(f"{name}: cpu serving cost per step "
                          f"{device.step_serving_us / 1e3:.2f} ms, first token "
                          f"{device.first_token_us / 1e3:.2f} ms (disaggregated "
                          f"{device.pd_first_token_us / 1e3:.2f} ms), host "
                          f"{device.layer_overhead_us / 1e3:.2f} ms per layer, collective "
                          f"{device.link_latency_us / 1e3:.2f} ms, Ray call "
                          f"{device.control_call_us / 1e3:.2f} ms")
                    for conc in args.concurrency:
                        wl = WorkloadSpec(IN, OUT, concurrency=conc, together=conc > 1)
                        for row in compare(name, load_config(path), orch.address, device,
                                           wl, args.reps, REQUESTS * conc):
                            print(row)
    finally:
        ray.shutdown()
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, "
          f"on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()

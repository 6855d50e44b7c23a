"""`orch plan` next to `orch bench` on a running cpu deployment (issue 17's check): the
prediction on the measured ``cpu`` device, the bench's median TTFT / TPOT over a few short
reps.

Used by ``benchmarks/plan_vs_bench.py``; the caller
brings the config up (``orch up``) and measures the device (:func:`.calibrate.measure_cpu`,
in the same run, just before: the machine's load moves the cpu figures).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.schema import OrchConfig
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.report import plan_config
from orchestrator.planner.specs import DeviceSpec


@dataclass(frozen=True)
class Row:
    """One figure of one config at one load: predicted and measured, ms."""

    config: str
    concurrency: int
    figure: str          # "TTFT" or "TPOT"
    predicted_ms: float
    measured_ms: float

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted_ms - self.measured_ms) / self.measured_ms

    def __str__(self) -> str:
        return (f"{self.config} x{self.concurrency} {self.figure}: plan "
                f"{self.predicted_ms:.1f} ms, bench {self.measured_ms:.1f} ms "
                f"({self.error:+.0%})")


def bench_ms(address: str, wl: WorkloadSpec, requests: int,
             warmup: int = 0) -> tuple[float, float]:
    """(median TTFT, median TPOT), ms, of ``requests`` synthetic requests of ``wl``'s shape,
    ``wl.concurrency`` in flight, against the router at ``address``: ``orch bench`` in a
    subprocess, a client process of its own as a user runs it.

    Raises:
        RuntimeError: the bench failed or a request did not complete (its output's tail).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "bench", "--address", address,
             "--workload", "synthetic", "--num-requests", str(requests), "--warmup",
             str(warmup), "--input-len", str(wl.input_len), "--output-len",
             str(wl.output_len), "--max-concurrency", str(wl.concurrency or 1),
             "--request-timeout", "60", "--no-progress", "--output", str(out)],
            capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"orch bench against {address} failed: "
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        report = json.loads(out.read_text())
    if report["counts"]["completed"] != requests:
        raise RuntimeError(f"orch bench against {address}: {report['counts']}")
    return report["ttft"]["p50_ms"], report["tpot"]["p50_ms"]


def compare(name: str, cfg: OrchConfig, address: str, device: DeviceSpec, wl: WorkloadSpec,
            reps: int, requests: int) -> list[Row]:
    """Plan vs bench of ``cfg`` (up at ``address``) for ``wl`` on ``device``: the measurement
    is the median of ``reps`` benches' medians, ``requests`` requests each.

    Raises:
        see :func:`bench_ms`; ConfigError: ``wl`` does not fit ``cfg``.
    """
    point = plan_config(cfg, wl, device).point
    meas = [bench_ms(address, wl, requests) for _ in range(reps)]
    conc = wl.concurrency or 1
    return [Row(name, conc, "TTFT", point.ttft_s * 1e3, statistics.median(m[0] for m in meas)),
            Row(name, conc, "TPOT", point.tpot_s * 1e3, statistics.median(m[1] for m in meas))]

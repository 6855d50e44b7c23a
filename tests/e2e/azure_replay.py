"""`orch bench` replaying the Azure conversation trace (30 requests, lengths scaled to the tiny
model) against a running `orch up`, and the trace's own lengths read straight from the CSV
(test_pd_end_to_end checks the report's counts against both and the router's metrics)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import REPO, OrchProcess

AZURE = "azure2023_AzureLLMInferenceTrace_conv.csv"  # in ../shared/data
N, SCALE, MAX_IN, MAX_OUT = 30, 0.1, 400, 48


def trace_lengths(azure: Path) -> tuple[list[tuple[int, int]], int]:
    """(input, output) tokens of the first N rows, scaled (round, >= 1) and capped; and how
    many rows the caps cut."""
    with azure.open() as f:
        rows = [r for _, r in zip(range(N), csv.DictReader(f))]
    scaled = [(max(1, round(int(r["ContextTokens"]) * SCALE)),
               max(1, round(int(r["GeneratedTokens"]) * SCALE))) for r in rows]
    capped = sum(1 for i, o in scaled if i > MAX_IN or o > MAX_OUT)
    return [(min(i, MAX_IN), min(o, MAX_OUT)) for i, o in scaled], capped


def bench_replay(orch: OrchProcess, azure: Path, out: Path) -> dict:
    """`orch bench --workload azure` of the first N rows against ``orch``; its JSON report."""
    subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "bench", "--address", orch.address,
         "--workload", "azure", "--trace", str(azure), "--num-requests", str(N),
         "--scale-lengths", str(SCALE), "--max-input-len", str(MAX_IN),
         "--max-output-len", str(MAX_OUT), "--time-scale", "0.25", "--no-progress",
         "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--output", str(out)],
        check=True, cwd=REPO, timeout=600)
    return json.loads(out.read_text())

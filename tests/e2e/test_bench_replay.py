"""`orch bench` replays 30 requests of the Azure conversation trace (lengths scaled to the tiny
model) through `orch up configs/hetero_tp_1p1d.yaml`; the report's counts match the trace (read here
straight from the CSV) and the router's Prometheus counters."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from tests.e2e.harness import REPO, OrchProcess, wait_idle

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


def test_azure_replay_counts_match_trace_and_metrics(tmp_path, shared_data, joined_ray):
    azure = shared_data(AZURE)
    expected, num_capped = trace_lengths(azure)
    report_path = tmp_path / "report.json"
    with OrchProcess(REPO / "configs" / "hetero_tp_1p1d.yaml", tmp_path, joined_ray) as orch:
        subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", "bench", "--address", orch.address,
             "--workload", "azure", "--trace", str(azure), "--num-requests", str(N),
             "--scale-lengths", str(SCALE), "--max-input-len", str(MAX_IN),
             "--max-output-len", str(MAX_OUT), "--time-scale", "0.25", "--no-progress",
             "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--output", str(report_path)],
            check=True, cwd=REPO, timeout=600)
        wait_idle(orch)
        metrics = orch.metrics()
    report = json.loads(report_path.read_text())
    counts = report["counts"]
    assert counts["requested"] == N and counts["completed"] == N and counts["failed"] == 0
    assert counts["capped"] == num_capped
    per_request = sorted(report["requests"], key=lambda r: r["index"])
    assert [(r["input_len"], r["output_tokens"]) for r in per_request] == expected
    total_out = sum(o for _, o in expected)
    total_in = sum(i for i, _ in expected)
    assert metrics["orch_requests_total{outcome=length}"] == N
    assert metrics["orch_generation_tokens_total"] == total_out
    assert metrics["orch_prompt_tokens_total"] == total_in
    assert metrics["orch_ttft_seconds_count"] == N
    assert report["goodput"] > 0
    # KV bytes per pair: P1 -> D2 sends every layer of every prompt token to both decode ranks.
    from engine.model_config import load_model_config
    from orchestrator.config.load import load_config

    model = load_model_config(load_config(REPO / "configs" / "hetero_tp_1p1d.yaml").model.checkpoint_dir())
    per_token = model.num_hidden_layers * (model.kv_lora_rank + model.qk_rope_head_dim) * 4
    for rank in (0, 1):
        pair = f"orch_kv_transfer_bytes_total{{pair=prefill-0:0->decode-0:{rank}}}"
        assert metrics[pair] == total_in * per_token
        assert metrics[f"orch_kv_transfer_seconds_count{{pair=prefill-0:0->decode-0:{rank}}}"] == N

"""`orch bench --backend openai` against orch's own HTTP side counts what the gRPC backend
counts on the same workload (requests, prompt and output tokens), and its failures by the
same status names."""

from __future__ import annotations

import asyncio

from orchestrator.bench.report import summarize
from orchestrator.bench.runner import run_benchmark
from orchestrator.bench.records import RunnerConfig
from orchestrator.bench.workloads import WorkloadConfig, load_workload
from tests.orchestrator.test_http_api import HttpHarness


def _report(cfg: RunnerConfig, workload):
    result = asyncio.run(run_benchmark(workload, cfg))
    report = summarize(result)
    inputs = sum(r.input_len for r in result.records if r.ok and not r.warmup)
    outputs = sum(r.num_output_tokens for r in result.records if r.ok and not r.warmup)
    return report, inputs, outputs


def test_openai_backend_counts_what_grpc_counts():
    h = HttpHarness(request_timeout_s=30)
    try:
        workload = load_workload(WorkloadConfig(kind="synthetic", num_requests=6, warmup=1,
                                                input_len=12, output_len=7, seed=1,
                                                token_range=(1000, 50000)))
        common = dict(progress=False, connect_timeout_s=5, request_timeout_s=20)
        grpc_report, grpc_in, grpc_out = _report(
            RunnerConfig(address=h.address, **common), workload)
        http_report, http_in, http_out = _report(
            RunnerConfig(backend="openai", base_url=h.url, **common), workload)
        assert http_report.counts == grpc_report.counts
        assert grpc_report.counts["completed"] == 6
        assert grpc_report.counts["output_len_mismatch"] == 0
        assert (http_in, http_out) == (grpc_in, grpc_out) == (6 * 12, 6 * 7)
        too_long = load_workload(WorkloadConfig(kind="synthetic", num_requests=2,
                                                input_len=200, output_len=100))
        failed, _, _ = _report(RunnerConfig(backend="openai", base_url=h.url, **common),
                               too_long)
        assert failed.errors == {"INVALID_ARGUMENT": 2}
    finally:
        h.close()


def test_cli_backend_openai(tmp_path, capsys):
    from orchestrator.bench.cli import main
    from orchestrator.bench.report import BenchReport

    h = HttpHarness()
    try:
        out = tmp_path / "r.json"
        assert main(["--backend", "openai", "--base-url", h.url, "--workload", "synthetic",
                     "--num-requests", "2", "--input-len", "8", "--output-len", "3",
                     "--token-range", "1000", "50000", "--no-progress",
                     "--output", str(out)]) == 0
        assert BenchReport.from_json(out).counts["completed"] == 2
        assert main(["--backend", "openai", "--workload", "synthetic"]) == 2
        assert "--base-url" in capsys.readouterr().err
    finally:
        h.close()

"""Runner against a scripted fake gRPC server: counts, error codes, timings, concurrency."""

from __future__ import annotations

import asyncio
import threading

import pytest

from bench_fake_orch import FakeOrch, FakeServer
from orchestrator.bench.report import summarize
from orchestrator.bench.runner import run_benchmark
from orchestrator.bench.records import RunnerConfig
from orchestrator.bench.workloads import WorkloadConfig, load_workload

TTFT_S, ITL_S = 0.15, 0.01


def _run(server: FakeServer, wl_cfg: WorkloadConfig, **runner_kw):
    workload = load_workload(wl_cfg)
    cfg = RunnerConfig(address=server.address, progress=False, connect_timeout_s=5,
                       request_timeout_s=10, **runner_kw)
    return workload, asyncio.run(run_benchmark(workload, cfg))


def _threads() -> set[str]:
    # NOTE: grpc's process-wide completion-queue poller (_poll_wrapper) lives for good.
    return {t.name for t in threading.enumerate() if "_poll_wrapper" not in t.name}


def test_runner_counts_errors_and_ttft():
    threads_before = _threads()
    fake = FakeOrch(TTFT_S, ITL_S, fail_every=4)
    with FakeServer(fake) as server:
        wl = WorkloadConfig(kind="synthetic", num_requests=12, warmup=1, input_len=16,
                            output_len=5, request_rate=50.0, seed=3)
        workload, result = _run(server, wl)
    report = summarize(result, num_capped=workload.num_capped, slo_ttft_ms=1e4,
                       slo_tpot_ms=1e4)
    # indices 0 (warm-up) .. 12; timed 1..12; failing: 4, 8, 12
    assert report.counts == {"requested": 12, "completed": 9, "failed": 3, "capped": 0,
                             "skipped": 0, "warmup": 1, "output_len_mismatch": 0}
    assert report.errors == {"RESOURCE_EXHAUSTED": 3}
    assert len(fake.requests) == 13
    sent = fake.requests[0]
    assert sent.sampling.max_tokens == 5 and sent.sampling.ignore_eos
    assert sent.sampling.temperature == 0.0 and len(sent.token_ids.ids) == 16
    # NOTE: upper bounds leave room for a loaded 2-core CI machine.
    assert TTFT_S * 1e3 <= report.ttft.p50_ms < TTFT_S * 1e3 + 400
    assert ITL_S * 1e3 <= report.itl.p50_ms < ITL_S * 1e3 + 100
    assert report.itl.n == 9 * 4
    assert report.output_tokens_per_s == pytest.approx(45 / result.duration_s)
    assert report.goodput == pytest.approx(9 / result.duration_s)
    ok = [r for r in result.records if r.ok and not r.warmup]
    assert all(r.num_output_tokens == 5 and r.finish_reason == "length" for r in ok)
    assert all(r.send_s >= r.scheduled_s - 1e-3 for r in ok)
    assert _threads() == threads_before


def test_runner_respects_max_concurrency_and_multi_token_messages():
    fake = FakeOrch(0.05, 0.01, tokens_per_msg=3)
    with FakeServer(fake) as server:
        wl = WorkloadConfig(kind="synthetic", num_requests=8, input_len=4, output_len=7,
                            request_rate=float("inf"))
        _, result = _run(server, wl, max_concurrency=2)
    assert fake.max_in_flight == 2
    rec = result.records[0]
    assert rec.chunk_tokens == (3, 3, 1) and rec.num_output_tokens == 7
    report = summarize(result)
    assert report.counts["completed"] == 8 and report.itl.n == 8 * 4


def test_runner_deadline_is_reported_not_raised():
    fake = FakeOrch(ttft_s=5.0, itl_s=0.0)
    with FakeServer(fake) as server:
        wl = WorkloadConfig(kind="synthetic", num_requests=2, input_len=4, output_len=2)
        workload = load_workload(wl)
        cfg = RunnerConfig(address=server.address, progress=False, request_timeout_s=0.3)
        result = asyncio.run(run_benchmark(workload, cfg))
    assert [r.error_code for r in result.records] == ["DEADLINE_EXCEEDED"] * 2
    assert result.duration_s < 3.0


def test_runner_unreachable_server_fails_fast():
    wl = load_workload(WorkloadConfig(kind="synthetic", num_requests=1))
    cfg = RunnerConfig(address="127.0.0.1:1", progress=False, connect_timeout_s=0.5)
    with pytest.raises(ConnectionError, match="orch up"):
        asyncio.run(run_benchmark(wl, cfg))

"""Report maths against hand-computed values; JSON round trip, compare table, CDF plots."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from orchestrator.bench.compare import compare_rows, print_comparison
from orchestrator.bench.plots import write_cdf_plots
from orchestrator.bench.report import BenchReport, itl_s, print_report, summarize, tpot_s
from orchestrator.bench.records import RequestRecord, RunResult


def _rec(index, send, times, tokens, end, *, out_len=3, in_len=10, code=None, warm=False):
    return RequestRecord(index=index, warmup=warm, input_len=in_len, output_len=out_len,
                         scheduled_s=send, send_s=send, chunk_times_s=tuple(times),
                         chunk_tokens=tuple(tokens), end_s=end,
                         finish_reason=None if code else "length", error_code=code)


def _run() -> RunResult:
    return RunResult(records=(
        _rec(0, 0.0, [0.05], [1], 0.05, out_len=1, warm=True),            # warm-up: ignored
        _rec(1, 0.0, [0.1, 0.2, 0.4], [1, 1, 1], 0.4, in_len=10),        # A
        _rec(2, 1.0, [1.3, 1.5], [1, 2], 1.5, in_len=20),                # B
        _rec(3, 0.5, [0.6], [1], 0.6, out_len=2, in_len=30),             # C: 1 token of 2
        _rec(4, 0.7, [], [], 0.8, code="RESOURCE_EXHAUSTED"),
        _rec(5, 0.9, [1.0], [1], 1.9, code="DEADLINE_EXCEEDED"),
    ), duration_s=2.0, started_at=0.0)


def test_per_request_tpot_and_itl():
    a, b, c = _run().records[1:4]
    assert tpot_s(a) == pytest.approx(0.15) and tpot_s(b) == pytest.approx(0.1)
    assert tpot_s(c) is None
    assert itl_s(a) == pytest.approx([0.1, 0.2])
    assert itl_s(b) == pytest.approx([0.1, 0.1])  # 2 tokens 0.2 s after the first: 0.1 each
    assert itl_s(c) == []


def test_summary_matches_hand_computed_values():
    rep = summarize(_run(), label="x", num_capped=2, num_skipped=1,
                    slo_ttft_ms=200, slo_tpot_ms=120)
    assert rep.counts == {"requested": 5, "completed": 3, "failed": 2, "capped": 2,
                          "skipped": 1, "warmup": 1, "output_len_mismatch": 1}
    assert rep.errors == {"DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 1}
    # TTFT ms [100, 300, 100]; linear interpolation on sorted [100, 100, 300]
    assert (rep.ttft.n, rep.ttft.mean_ms) == (3, pytest.approx(500 / 3))
    assert (rep.ttft.p50_ms, rep.ttft.p90_ms, rep.ttft.p99_ms) == pytest.approx((100, 260, 296))
    # TPOT ms [150, 100]
    assert (rep.tpot.n, rep.tpot.mean_ms) == (2, pytest.approx(125))
    assert (rep.tpot.p50_ms, rep.tpot.p90_ms, rep.tpot.p99_ms) == pytest.approx((125, 145, 149.5))
    # ITL ms [100, 200, 100, 100]
    assert (rep.itl.n, rep.itl.mean_ms) == (4, pytest.approx(125))
    assert (rep.itl.p50_ms, rep.itl.p90_ms, rep.itl.p99_ms) == pytest.approx((100, 170, 197))
    # E2E ms [400, 500, 100]
    assert rep.e2e.mean_ms == pytest.approx(1000 / 3)
    assert (rep.e2e.p50_ms, rep.e2e.p90_ms, rep.e2e.p99_ms) == pytest.approx((400, 480, 498))
    assert rep.request_throughput == pytest.approx(1.5)
    assert rep.input_tokens_per_s == pytest.approx(30.0)
    assert rep.output_tokens_per_s == pytest.approx(3.5)
    # A misses TPOT (150 > 120), B misses TTFT (300 > 200), C meets both (no TPOT)
    assert rep.goodput == pytest.approx(0.5)
    assert summarize(_run(), slo_tpot_ms=120).goodput == pytest.approx(1.0)
    assert summarize(_run()).goodput is None
    assert [r["error_code"] for r in rep.requests] == [None, None, None, "RESOURCE_EXHAUSTED",
                                                       "DEADLINE_EXCEEDED"]


def test_json_round_trip_and_table(tmp_path):
    rep = summarize(_run(), label="base", workload="synthetic")
    rep.to_json(tmp_path / "sub" / "a.json")
    back = BenchReport.from_json(tmp_path / "sub" / "a.json")
    assert back == rep
    out = io.StringIO()
    print_report(rep, Console(file=out, width=120))
    text = out.getvalue()
    assert "TTFT" in text and "RESOURCE_EXHAUSTED=1" in text and "1.500 req/s" in text
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="orch bench --output"):
        BenchReport.from_json(tmp_path / "bad.json")


def test_compare_ratios(tmp_path):
    a = summarize(_run(), label="a")
    slower = RunResult(records=_run().records, duration_s=4.0, started_at=0.0)
    b = summarize(slower, label="b")
    rows = {m: (x, y, r) for m, x, y, r in compare_rows(a, b)}
    assert rows["request_throughput"] == pytest.approx((1.5, 0.75, 0.5))
    assert rows["ttft.p50_ms"] == pytest.approx((100, 100, 1.0))
    assert rows["count.completed"] == (3, 3, 1.0)
    assert rows["goodput"] == (None, None, None)
    a.to_json(tmp_path / "a.json")
    b.to_json(tmp_path / "b.json")
    out = io.StringIO()
    print_comparison(tmp_path / "a.json", tmp_path / "b.json", Console(file=out, width=120))
    line = next(ln for ln in out.getvalue().splitlines() if "request_throughput" in ln)
    assert "1.500" in line and "0.750" in line and "0.500" in line


def test_cdf_plots_written(tmp_path):
    rep = summarize(_run(), label="run 1")
    paths = write_cdf_plots(rep, tmp_path / "plots")
    assert sorted(p.name for p in paths) == ["run_1_tpot_cdf.png", "run_1_ttft_cdf.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_report_prefix_hit_rate_counts_cached_prompt_tokens():
    from orchestrator.bench.records import RequestRecord, RunResult
    from orchestrator.bench.report import summarize

    def rec(i, input_len, cached):
        return RequestRecord(index=i, warmup=False, input_len=input_len, output_len=1,
                             scheduled_s=0.0, send_s=0.0, chunk_times_s=(0.1,),
                             chunk_tokens=(1,), end_s=0.2, finish_reason="length",
                             cached_tokens=cached)

    report = summarize(RunResult((rec(0, 100, 0), rec(1, 100, 64), rec(2, 200, 96)), 1.0, 0.0))
    assert report.prefix_hit_rate == (64 + 96) / 400


def test_each_request_row_carries_its_own_ttft_phases_in_ms():
    """A tail is read request by request: the row of a request keeps its server breakdown
    (seconds -> ms), a request without one an empty dict."""
    from dataclasses import replace

    run = _run()
    slow = replace(run.records[2], ttft_phases={"queue": 0.25, "forward": 0.02})
    rep = summarize(replace(run, records=(*run.records[:2], slow, *run.records[3:])))
    rows = {r["index"]: r for r in rep.requests}
    assert rows[2]["ttft_phases_ms"] == pytest.approx({"queue": 250.0, "forward": 20.0})
    assert rows[1]["ttft_phases_ms"] == {}
    assert rep.ttft_phases == pytest.approx({"queue": 250.0, "forward": 20.0})

"""orch bench's TTFT breakdown: per phase p50 over the requests whose final stats carried one,
in the router's phase order, printed next to the client's TTFT p50."""

from __future__ import annotations

from orchestrator.bench.records import RequestRecord
from orchestrator.bench.ttft_breakdown import format_ttft_breakdown, ttft_breakdown
from orchestrator.router.request import TTFT_PHASES


def _rec(phases: dict[str, float]) -> RequestRecord:
    return RequestRecord(index=0, warmup=False, input_len=4, output_len=2, scheduled_s=0.0,
                         send_s=0.0, chunk_times_s=(0.1,), chunk_tokens=(2,), end_s=0.2,
                         finish_reason="length", ttft_phases=phases)


def test_median_per_phase_in_router_order():
    recs = [_rec({"forward": f, "tokenize": 0.001, "queue": q})
            for f, q in ((0.010, 0.0), (0.030, 0.002), (0.020, 0.004))] + [_rec({})]
    out = ttft_breakdown(recs)
    assert list(out) == [p for p in TTFT_PHASES if p in ("tokenize", "queue", "forward")]
    assert out == {"tokenize": 1.0, "queue": 2.0, "forward": 20.0}
    line = format_ttft_breakdown(out, 25.0)
    assert "tokenize 1.00, queue 2.00, forward 20.00; sum 23.00 vs client TTFT p50 25.00" in line
    assert ttft_breakdown([_rec({})]) == {}

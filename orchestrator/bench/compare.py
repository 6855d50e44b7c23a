"""Side-by-side comparison of two bench reports (``orch bench --compare A.json B.json``)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.bench.report import BenchReport

_DISTS = ("ttft", "tpot", "itl", "e2e")
_STATS = ("mean_ms", "p50_ms", "p90_ms", "p99_ms")
_RATES = ("request_throughput", "input_tokens_per_s", "output_tokens_per_s", "goodput")
_COUNTS = ("requested", "completed", "failed", "capped", "skipped")


def compare_rows(a: BenchReport, b: BenchReport) -> list[tuple[str, float | None,
                                                               float | None, float | None]]:
    """``(metric, A, B, B/A)`` for every latency statistic, rate and count.

    The ratio is None when either side is missing or A is 0.
    """
    rows = []
    for d in _DISTS:
        for s in _STATS:
            rows.append((f"{d}.{s}", getattr(getattr(a, d), s), getattr(getattr(b, d), s)))
    rows += [(r, getattr(a, r), getattr(b, r)) for r in _RATES]
    rows += [(f"count.{c}", a.counts.get(c), b.counts.get(c)) for c in _COUNTS]
    rows.append(("duration_s", a.duration_s, b.duration_s))
    return [(m, x, y, None if x is None or y is None or x == 0 else y / x) for m, x, y in rows]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_comparison(path_a: str | Path, path_b: str | Path, console=None) -> None:
    """Print A and B side by side with B/A per metric (lower latency / higher rate is better).

    Raises:
        ValueError: a file is not a bench report.
    """
    from rich.console import Console
    from rich.table import Table

    a, b = BenchReport.from_json(path_a), BenchReport.from_json(path_b)
    console = console or Console()
    console.print(f"A = {path_a}: {a.label} ({a.workload})")
    console.print(f"B = {path_b}: {b.label} ({b.workload})")
    table = Table("metric", "A", "B", "B/A")
    for metric, x, y, ratio in compare_rows(a, b):
        table.add_row(metric, _fmt(x), _fmt(y), _fmt(ratio))
    console.print(table)

"""Benchmark statistics from request records: latency distributions, throughput, goodput.

Definitions (those of vLLM's ``benchmark_serving.py`` and SGLang's ``bench_serving.py``):

- TTFT: send -> first message carrying a token, per completed request.
- E2E: send -> end of the stream, per completed request.
- TPOT: per completed request with n_out > 1 tokens, ``(e2e - ttft) / (n_out - 1)``; the
  distribution is over requests (each request weighs the same).
- ITL: gaps between token arrivals over all tokens of all completed requests. A message with
  k tokens arriving ``g`` seconds after the previous one contributes k gaps of ``g / k``
  (SGLang's convention); the first message contributes none.
- Percentiles: numpy's default linear interpolation, ``np.percentile(x, q)``.
- Throughput: completed requests, their prompt tokens and their output tokens per second of
  the timed phase (``duration_s``: time 0 to the last stream end).
- Goodput: completed requests per second with TTFT <= ``slo_ttft_ms`` and TPOT <=
  ``slo_tpot_ms`` (an unset SLO always holds; a 1-token request has no TPOT and meets it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from orchestrator.bench.records import RequestRecord, RunResult
from orchestrator.bench.ttft_breakdown import format_ttft_breakdown, ttft_breakdown

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Distribution:
    """Summary of a sample, in milliseconds (None when the sample is empty)."""

    n: int
    mean_ms: float | None
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None

    @classmethod
    def of(cls, values_s: list[float]) -> "Distribution":
        """Distribution of ``values_s`` (seconds)."""
        if not values_s:
            return cls(0, None, None, None, None)
        ms = np.asarray(values_s, dtype=np.float64) * 1e3
        p = [float(np.percentile(ms, q)) for q in PERCENTILES]
        return cls(len(ms), float(ms.mean()), *p)


def tpot_s(rec: RequestRecord) -> float | None:
    """``(e2e - ttft) / (n_out - 1)`` seconds, or None for fewer than 2 tokens."""
    n = rec.num_output_tokens
    if n < 2 or rec.ttft_s is None:
        return None
    return (rec.e2e_s - rec.ttft_s) / (n - 1)


def itl_s(rec: RequestRecord) -> list[float]:
    """Per-token gaps (seconds) after the first message; ``n_out - chunk_tokens[0]`` values."""
    gaps: list[float] = []
    for i in range(1, len(rec.chunk_times_s)):
        k = rec.chunk_tokens[i]
        gaps.extend([(rec.chunk_times_s[i] - rec.chunk_times_s[i - 1]) / k] * k)
    return gaps


def meets_slo(rec: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a completed request meets both SLOs (see the module docstring)."""
    ttft, tpot = rec.ttft_s, tpot_s(rec)
    ok_ttft = slo_ttft_ms is None or (ttft is not None and ttft * 1e3 <= slo_ttft_ms)
    ok_tpot = slo_tpot_ms is None or tpot is None or tpot * 1e3 <= slo_tpot_ms
    return rec.ok and ok_ttft and ok_tpot


@dataclass(frozen=True)
class BenchReport:
    """Everything one run measured. Times in the distributions are milliseconds.

    Attributes:
        label: the run's label.
        workload: one-line description of the workload.
        duration_s: timed phase, seconds.
        counts: requested, completed, failed, capped, skipped, warmup, and
            output_len_mismatch (completed requests that got a different number of tokens than
            asked for: EOS not ignored or a server bug).
        errors: failed requests by status code.
        ttft, tpot, itl, e2e: latency distributions.
        request_throughput, input_tokens_per_s, output_tokens_per_s: per second of duration_s.
        goodput: requests/s meeting the SLOs, None when no SLO was given.
        slo_ttft_ms, slo_tpot_ms: the SLOs.
        requests: per timed request: index, input_len, output_tokens, ttft_ms, tpot_ms,
            e2e_ms, error_code, ttft_phases_ms (the server's TTFT breakdown, phase -> ms;
            empty when the server sent none).
        prefix_hit_rate: prompt tokens the servers found in their prefix cache / prompt tokens,
            over completed requests (final stats' cached_tokens).
        kv_tail: decode instance -> the run's ``kv_tail_s`` (end of the prefill forward of
            a request's last chunk -> decode holds every cell): ``{"requests", "mean_ms",
            "max_ms"}``, from the leaders' status before and after the run (gRPC backend;
            ``orchestrator.bench.step_breakdown.kv_tail_of_run``); empty when not read.
        ttft_phases: the server's TTFT breakdown over completed requests, phase -> p50 ms
            (``orchestrator.bench.step_breakdown.ttft_breakdown``); empty when the server
            sent none (OpenAI backend).
    """

    label: str
    workload: str
    duration_s: float
    counts: dict[str, int]
    errors: dict[str, int]
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution
    request_throughput: float
    input_tokens_per_s: float
    output_tokens_per_s: float
    goodput: float | None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    requests: list[dict] = field(default_factory=list)
    prefix_hit_rate: float = 0.0
    kv_tail: dict[str, dict] = field(default_factory=dict)
    ttft_phases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: str | Path) -> None:
        """Write the report (indented JSON) to ``path``, creating its folder."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "BenchReport":
        """Read a report written by :meth:`to_json`.

        Raises:
            ValueError: the file is not a bench report (names the missing field).
        """
        data = json.loads(Path(path).read_text())
        try:
            for key in ("ttft", "tpot", "itl", "e2e"):
                data[key] = Distribution(**data[key])
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path} is not an `orch bench --output` report: {e}") from None


def _row(rec: RequestRecord) -> dict:
    ttft, tpot = rec.ttft_s, tpot_s(rec)
    return {"index": rec.index, "input_len": rec.input_len,
            "output_tokens": rec.num_output_tokens,
            "ttft_ms": None if ttft is None else ttft * 1e3,
            "tpot_ms": None if tpot is None else tpot * 1e3,
            "e2e_ms": rec.e2e_s * 1e3, "error_code": rec.error_code,
            "ttft_phases_ms": {p: s * 1e3 for p, s in rec.ttft_phases.items()}}


def summarize(run: RunResult, *, label: str = "", workload: str = "", num_capped: int = 0,
              num_skipped: int = 0, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> BenchReport:
    """The :class:`BenchReport` of a run (warm-up records are counted, never measured)."""
    timed = [r for r in run.records if not r.warmup]
    done = [r for r in timed if r.ok]
    errors: dict[str, int] = {}
    for r in timed:
        if not r.ok:
            errors[r.error_code] = errors.get(r.error_code, 0) + 1
    dur = run.duration_s if run.duration_s > 0 else float("inf")  # NOTE: no time -> rates 0
    tpots = [t for t in map(tpot_s, done) if t is not None]
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in done) / dur
    counts = {"requested": len(timed), "completed": len(done), "failed": len(timed) - len(done),
              "capped": num_capped, "skipped": num_skipped,
              "warmup": len(run.records) - len(timed),
              "output_len_mismatch": sum(r.num_output_tokens != r.output_len for r in done)}
    return BenchReport(
        label=label, workload=workload, duration_s=run.duration_s, counts=counts,
        errors=dict(sorted(errors.items())),
        ttft=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Distribution.of(tpots), itl=Distribution.of([g for r in done for g in itl_s(r)]),
        e2e=Distribution.of([r.e2e_s for r in done]),
        request_throughput=len(done) / dur,
        input_tokens_per_s=sum(r.input_len for r in done) / dur,
        output_tokens_per_s=sum(r.num_output_tokens for r in done) / dur,
        goodput=good, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
        requests=[_row(r) for r in timed],
        prefix_hit_rate=sum(r.cached_tokens for r in done) / max(
            1, sum(r.input_len for r in done)),
        ttft_phases=ttft_breakdown(done))


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_report(report: BenchReport, console=None) -> None:
    """Print a short table of the report with rich (to ``console``, default stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c = report.counts
    console.print(f"[bold]{report.label or 'orch bench'}[/]: {report.workload}")
    console.print(
        f"requests: {c['requested']} sent, {c['completed']} completed, {c['failed']} failed, "
        f"{c['capped']} capped, {c['skipped']} skipped, {c['warmup']} warm-up; "
        f"duration {report.duration_s:.2f} s")
    if report.errors:
        console.print("errors: " + ", ".join(f"{k}={v}" for k, v in report.errors.items()))
    if c.get("output_len_mismatch"):
        console.print(f"[yellow]{c['output_len_mismatch']} completed requests got a different "
                      "number of tokens than asked for[/]")
    table = Table("metric (ms)", "mean", "p50", "p90", "p99", "n")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d: Distribution = getattr(report, name)
        table.add_row(name.upper(), _fmt(d.mean_ms), _fmt(d.p50_ms), _fmt(d.p90_ms),
                      _fmt(d.p99_ms), str(d.n))
    console.print(table)
    console.print(
        f"throughput: {report.request_throughput:.3f} req/s, "
        f"input {report.input_tokens_per_s:.1f} tok/s, "
        f"output {report.output_tokens_per_s:.1f} tok/s, "
        f"prefix cache hit rate {report.prefix_hit_rate:.3f}"
        + ("" if report.goodput is None else
           f", goodput {report.goodput:.3f} req/s (TTFT <= {_fmt(report.slo_ttft_ms, 0)} ms, "
           f"TPOT <= {_fmt(report.slo_tpot_ms, 0)} ms)"))
    if report.ttft_phases:
        console.print(format_ttft_breakdown(report.ttft_phases, report.ttft.p50_ms),
                      markup=False, highlight=False, soft_wrap=True)


def print_kv_tail(report: BenchReport, console=None) -> None:
    """One line per decode instance of ``report.kv_tail`` (nothing when empty)."""
    if not report.kv_tail:
        return
    from rich.console import Console

    console = console or Console()
    console.print("kv_tail_s (prefill forward end -> decode holds every cell): " + ", ".join(
        f"{name} {t['requests']} requests mean {t['mean_ms']:.2f} ms (max so far "
        f"{t['max_ms']:.2f} ms)" for name, t in sorted(report.kv_tail.items())),
        markup=False, highlight=False, soft_wrap=True)

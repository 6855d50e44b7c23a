"""PD (1P1D) against colocated serving: the same replay against each, side by side in one run.

Deployments, each an ``orch up`` on free loopback ports (:func:`orchestrator.bench.serve.serving`):

- ``pd``: configs/1p1d.yaml, prefill tp 1 -> decode tp ``--tp``: up for the whole run;
- ``colocated-dp1``: configs/colocated.yaml, one instance of tp ``--tp``: the baseline of the
  unloaded level (concurrency 1), up while that level runs;
- ``colocated-dp2``: the same with ``decode.dp: 2``: the baseline of the loaded levels (as
  many rank processes as 1P1D at tp 1: two), up while they run.

The machine is shared and its load drifts, so each level is replayed ``--rounds`` times,
alternating the two sides (ABBA...), while both are up (an idle deployment costs both sides
alike); per side the median over rounds is reported. Every deployment gets the same scheduler
sizes (``max_num_seqs``, ``num_kv_blocks`` enough for the largest level, the configs' prefill
chunking; ``--pd-prefill-chunk`` changes PD's) and the same torch threads per rank: ``ORCH_TORCH_THREADS=--threads``
(engine/envs.py) in the environment of ``orch up``, which its Ray workers inherit. One replay
of level ``c`` sends ``max(--min-requests, 2 c)`` requests, ``c`` at a time, after
``--warmup`` warm-up requests, with the bench client (``orch bench``'s runner and synthetic
workload, one seed); each asks for exactly ``--output-len`` tokens (greedy, EOS ignored) of
an ``--input-len``-token prompt.

Printed per level: TTFT / TPOT (mean and p50 over requests) and ITL p50 in ms, output tokens/s, the PD / colocated
ratios of the medians and the range of the per-round ratios; after each level, every
leader's step time breakdown over its rounds (``orch bench``'s, from ``GetStatus``).
Reports: ``--out/<deployment>-c<level>-r<round>.json``, ``--out/summary.json``.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_bench.py [--tp 1] [--levels 1 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from orchestrator.bench.report import summarize
from orchestrator.bench.runner import run_benchmark
from orchestrator.bench.records import RunnerConfig
from orchestrator.bench.serve import serving
from orchestrator.bench.step_breakdown import print_step_breakdown, read_statuses
from orchestrator.bench.workloads import WorkloadConfig, load_workload

REPO = Path(__file__).resolve().parents[1]
# (report key, figure) compared per level; lower is better except output tokens/s.
# Means are the figures; p50s (over requests) resist the outliers a shared machine
# makes.
METRICS = (("ttft_ms", "TTFT"), ("ttft_p50_ms", "TTFT p50"), ("tpot_ms", "TPOT"),
           ("tpot_p50_ms", "TPOT p50"), ("itl_p50_ms", "ITL p50"), ("output_tok_s", "tok/s"))


@dataclass(frozen=True)
class Deployment:
    """One side of the comparison: a config file under configs/ with overrides."""

    name: str
    base: str
    overrides: dict


def deployments(args: argparse.Namespace) -> dict[str, Deployment]:
    """``pd``, ``colocated-dp1`` and ``colocated-dp2`` with the same scheduler sizes (PD's
    prefill chunk is ``args.pd_prefill_chunk`` when set)."""
    top = max(args.levels)
    blocks = top * math.ceil((args.input_len + args.output_len) / 16) + 16
    # NOTE: prefix cache off: every round replays the same prompts, which would then be
    # cached from the second round on (benchmarks/prefix_cache_bench.py measures the cache)
    sched = {"max_num_seqs": max(top, 8), "num_kv_blocks": blocks, "prefix_cache": False}
    common = {"router": {"max_pending": 2 * top, "metrics_port": None},
              "model": {"max_model_len": args.input_len + args.output_len}}
    chunk = getattr(args, "pd_prefill_chunk", None)
    pd_prefill = {**sched, "dp": 1, "tp": 1, **({"chunk_size": chunk} if chunk else {})}
    return {
        "pd": Deployment("pd", "1p1d.yaml", {**common, "prefill": pd_prefill,
                                             "decode": {**sched, "dp": 1, "tp": args.tp}}),
        "colocated-dp1": Deployment("colocated-dp1", "colocated.yaml",
                                    {**common, "decode": {**sched, "dp": 1, "tp": args.tp}}),
        "colocated-dp2": Deployment("colocated-dp2", "colocated.yaml",
                                    {**common, "decode": {**sched, "dp": 2, "tp": args.tp}}),
    }


def write_config(dep: Deployment, directory: Path) -> Path:
    """``configs/<base>`` with ``dep.overrides`` merged one level deep, as ``<name>.yaml``."""
    data = yaml.safe_load((REPO / "configs" / dep.base).read_text())
    for section, values in dep.overrides.items():
        data[section] = {**(data.get(section) or {}), **values}
    path = directory / f"{dep.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def replay_level(args: argparse.Namespace, address: str, label: str, level: int,
                 report: Path) -> dict:
    """One replay of level ``level`` against ``address``: its figures (ms, tokens/s).

    Raises:
        RuntimeError: a request failed (the report at ``report`` says which).
    """
    workload = load_workload(WorkloadConfig(
        kind="synthetic", num_requests=max(args.min_requests, 2 * level), warmup=args.warmup,
        seed=args.seed, request_rate=float("inf"), input_len=args.input_len,
        output_len=args.output_len))
    result = asyncio.run(run_benchmark(workload, RunnerConfig(
        address=address, max_concurrency=level, label=label, progress=False)))
    rep = summarize(result, label=label, workload=workload.description)
    rep.to_json(report)
    if rep.counts["failed"]:
        raise RuntimeError(f"{label}: {rep.counts['failed']} request(s) failed: {rep.errors}; "
                           f"see {report}")
    return {"ttft_ms": rep.ttft.mean_ms, "ttft_p50_ms": rep.ttft.p50_ms,
            "tpot_ms": rep.tpot.mean_ms, "tpot_p50_ms": rep.tpot.p50_ms,
            "itl_p50_ms": rep.itl.p50_ms, "output_tok_s": rep.output_tokens_per_s}


def compare_level(args: argparse.Namespace, level: int, sides: dict[str, str]) -> dict:
    """``--rounds`` replays of ``level`` on each side of ``sides`` (name -> address, PD
    first), alternating the order each round; per side the list of figures per round."""
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    before = {name: _timings(address) for name, address in sides.items()}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            label = f"{name}-c{level}-r{r}"
            runs[name].append(replay_level(args, sides[name], label, level,
                                           args.out / f"{label}.json"))
    for name, address in sides.items():
        print(f"{name}, concurrency {level}, all rounds:", end=" ")
        print_step_breakdown(before[name], _timings(address))
    return runs


def _timings(address: str) -> dict:
    """instance name -> its leader's step timings now (orchestrator/bench/step_breakdown.py)."""
    return asyncio.run(read_statuses(RunnerConfig(address=address, progress=False)))


def summarize_level(level: int, base: str, runs: dict[str, list[dict]]) -> dict:
    """Medians per side, ratio of the medians and the range of the per-round ratios."""
    pd, colo = runs["pd"], runs[base]
    row = {"level": level, "baseline": base}
    for key, _ in METRICS:
        p = statistics.median(x[key] for x in pd)
        c = statistics.median(x[key] for x in colo)
        per_round = [a[key] / b[key] for a, b in zip(pd, colo)]
        row[key] = {"pd": p, "colocated": c, "ratio": p / c,
                    "round_ratios": (min(per_round), max(per_round))}
    return row


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nPD (prefill tp1 -> decode tp{args.tp}) vs colocated tp{args.tp}: "
          f"{args.input_len}-token prompts, {args.output_len} output tokens, "
          f"ORCH_TORCH_THREADS={args.threads} per rank on both sides, median of "
          f"{args.rounds} alternating rounds; PD prefill chunk "
          f"{args.pd_prefill_chunk or 'from configs/1p1d.yaml'}")
    print("| concurrency | colocated | " + " | ".join(
        f"{name} PD / colo (ratio) [round range]" for _, name in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for row in rows:
        cells = []
        for key, _ in METRICS:
            m = row[key]
            lo, hi = m["round_ratios"]
            cells.append(f"{m['pd']:.1f} / {m['colocated']:.1f} (**{m['ratio']:.2f}**) "
                         f"[{lo:.2f}-{hi:.2f}]")
        print(f"| {row['level']} | {row['baseline'].split('-')[1]} | " + " | ".join(cells)
              + " |")


def run(args: argparse.Namespace) -> list[dict]:
    """PD up for the whole run; colocated dp 1 for level 1, then dp 2 for the others."""
    deps = deployments(args)
    rows = []
    phases = [("colocated-dp1", [c for c in args.levels if c == 1]),
              ("colocated-dp2", [c for c in args.levels if c > 1])]
    with serving(write_config(deps["pd"], args.out), args.out, args.startup_timeout) as pd:
        for base, levels in phases:
            if not levels:
                continue
            with serving(write_config(deps[base], args.out), args.out,
                         args.startup_timeout) as colo:
                for level in levels:
                    runs = compare_level(args, level, {"pd": pd, base: colo})
                    rows.append(summarize_level(level, base, runs))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="decode tp (colocated tp), default 1")
    ap.add_argument("--threads", type=int, default=1, help="ORCH_TORCH_THREADS of every rank")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32],
                    help="concurrency levels (1 = unloaded, against colocated dp 1)")
    ap.add_argument("--pd-prefill-chunk", type=int, default=None,
                    help="PD's prefill.chunk_size (default: configs/1p1d.yaml's, 256, as "
                         "colocated's); a prefill instance has no decode steps to keep short")
    ap.add_argument("--rounds", type=int, default=3, help="alternating replays per level")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=16, help="timed requests per replay")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    ap.add_argument("--out", type=Path, default=Path("out/serve_bench"))
    args = ap.parse_args()
    os.environ["ORCH_TORCH_THREADS"] = str(args.threads)  # inherited by orch up and Ray
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run(args)
    print_table(rows, args)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""PD (1P1D) against colocated serving: the same replay against each, side by side in one run.

Deployments, brought up one after the other with ``orch up`` on free loopback ports
(:func:`orchestrator.bench.serve.serving`), each replaying its load levels with the bench
client (``orch bench``'s runner and synthetic workload, one seed for all) and then drained:

- ``colocated-dp1``: configs/colocated.yaml, one instance of tp ``--tp``: the baseline of the
  unloaded level (concurrency 1);
- ``colocated-dp2``: the same with ``decode.dp: 2``: the baseline of the loaded levels (as
  many rank processes as 1P1D at tp 1: two);
- ``pd``: configs/1p1d.yaml, prefill tp 1 -> decode tp ``--tp``: every level.

Every deployment gets the same scheduler sizes (``max_num_seqs``, ``num_kv_blocks`` enough
for the largest level, the configs' prefill chunking) and the same torch threads per rank:
``ORCH_TORCH_THREADS=--threads`` (engine/envs.py) in the environment of ``orch up``, which its
Ray workers inherit. Level ``c`` sends ``max(--min-requests, 4 c)`` requests, ``c`` at a
time, after ``--warmup`` warm-up requests; each asks for exactly ``--output-len`` tokens
(greedy, EOS ignored) of a ``--input-len``-token synthetic prompt.

Printed per level: TTFT / TPOT (mean, p50) and ITL p50 in ms, output tokens/s, and the
PD / colocated ratios; then each leader's status fields beyond the basic load (the per-step
phase timings, where the leaders report them). Reports: ``--out/<deployment>-c<level>.json``.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_bench.py [--tp 1] [--levels 1 8 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from orchestrator.bench.cli import add_arguments, replay
from orchestrator.bench.serve import serving
from orchestrator.client import OrchClient
from prefill_worker.messages import InstanceStatusInfo

REPO = Path(__file__).resolve().parents[1]
# InstanceStatusInfo fields every leader had before step timings: not printed as breakdown.
_BASIC_FIELDS = {"name", "role", "tp", "ranks", "queue_depth", "running", "free_blocks",
                 "total_blocks", "outstanding_tokens", "kv_bytes_sent", "kv_failures",
                 "transfers", "broken"}


@dataclass(frozen=True)
class Deployment:
    """One side of the comparison: a config with overrides, and the levels it serves."""

    name: str
    base: str  # config file under configs/
    overrides: dict
    levels: tuple[int, ...]


def deployments(args: argparse.Namespace) -> list[Deployment]:
    """colocated dp 1 (level 1), colocated dp 2 (levels > 1), 1P1D (all levels)."""
    top = max(args.levels)
    blocks = top * math.ceil((args.input_len + args.output_len) / 16) + 16
    sched = {"max_num_seqs": max(top, 8), "num_kv_blocks": blocks}
    common = {"router": {"max_pending": 2 * top, "metrics_port": None}, "model": {"max_model_len":
                                                             args.input_len + args.output_len}}
    loaded = tuple(c for c in args.levels if c > 1)
    out = []
    if 1 in args.levels:
        out.append(Deployment("colocated-dp1", "colocated.yaml",
                              {**common, "decode": {**sched, "dp": 1, "tp": args.tp}}, (1,)))
    if loaded:
        out.append(Deployment("colocated-dp2", "colocated.yaml",
                              {**common, "decode": {**sched, "dp": 2, "tp": args.tp}}, loaded))
    out.append(Deployment("pd", "1p1d.yaml",
                          {**common, "decode": {**sched, "dp": 1, "tp": args.tp},
                           "prefill": {**sched, "dp": 1, "tp": 1}}, tuple(args.levels)))
    return out


def write_config(dep: Deployment, directory: Path) -> Path:
    """``configs/<base>`` with ``dep.overrides`` merged one level deep, as ``<name>.yaml``."""
    data = yaml.safe_load((REPO / "configs" / dep.base).read_text())
    for section, values in dep.overrides.items():
        data[section] = {**(data.get(section) or {}), **values}
    path = directory / f"{dep.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def bench_args(args: argparse.Namespace, address: str, label: str, level: int,
               report: Path) -> argparse.Namespace:
    """``orch bench`` options of one level's replay."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--address", address, "--workload", "synthetic", "--seed", str(args.seed),
        "--num-requests", str(max(args.min_requests, 4 * level)),
        "--warmup", str(args.warmup), "--request-rate", "inf",
        "--max-concurrency", str(level), "--input-len", str(args.input_len),
        "--output-len", str(args.output_len), "--label", label, "--output", str(report),
        "--no-progress"])


def step_breakdown(address: str) -> list[str]:
    """One line per leader with its status fields beyond the basic load (e.g. step phase
    timings); empty lines are left out."""
    with OrchClient(address) as client:
        views, _, _ = client.status()
    lines = []
    for view in views:
        st: InstanceStatusInfo | None = view.status
        if st is None:
            continue
        extra = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)
                 if f.name not in _BASIC_FIELDS}
        if extra:
            lines.append(f"  {view.name}: {extra}")
    return lines


def run_deployment(dep: Deployment, args: argparse.Namespace, out: Path) -> dict[int, dict]:
    """Bring ``dep`` up, replay each of its levels, bring it down; level -> report dict."""
    reports = {}
    config = write_config(dep, out)
    with serving(config, out, args.startup_timeout) as address:
        for level in dep.levels:
            path = out / f"{dep.name}-c{level}.json"
            code = replay(bench_args(args, address, f"{dep.name}-c{level}", level, path))
            if code != 0:
                raise RuntimeError(f"{dep.name} level {level}: replay exited with {code}; "
                                   f"see {path} and {out / (dep.name + '.up.log')}")
            reports[level] = json.loads(path.read_text())
            for line in step_breakdown(address):
                print(line)
    return reports


def summary_rows(pd: dict[int, dict], base: dict[int, dict]) -> list[dict]:
    """Per level: the figures of both sides and the PD / colocated ratios."""
    rows = []
    for level in sorted(pd):
        p, c = pd[level], base[level]
        row = {"level": level}
        for side, rep in (("pd", p), ("colocated", c)):
            row[side] = {"ttft_mean_ms": rep["ttft"]["mean_ms"], "ttft_p50_ms":
                         rep["ttft"]["p50_ms"], "tpot_mean_ms": rep["tpot"]["mean_ms"],
                         "tpot_p50_ms": rep["tpot"]["p50_ms"], "itl_p50_ms": rep["itl"]["p50_ms"],
                         "output_tok_s": rep["output_tokens_per_s"],
                         "failed": rep["counts"]["failed"]}
        row["ratio"] = {k: row["pd"][k] / row["colocated"][k]
                        for k in ("ttft_mean_ms", "tpot_mean_ms", "itl_p50_ms", "output_tok_s")}
        rows.append(row)
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nPD (prefill tp1 -> decode tp{args.tp}) vs colocated tp{args.tp}; "
          f"{args.input_len}-token prompts, {args.output_len} output tokens, "
          f"ORCH_TORCH_THREADS={args.threads} per rank on both sides")
    print(f"{'conc':>4} {'base':>6} | {'TTFT ms':>15} {'TPOT ms':>13} {'ITL p50':>13} "
          f"{'out tok/s':>15} | {'TTFT':>5} {'TPOT':>5} {'ITL':>5} {'tok/s':>5}")
    for r in rows:
        p, c, x = r["pd"], r["colocated"], r["ratio"]
        base = "dp1" if r["level"] == 1 else "dp2"
        print(f"{r['level']:>4} {base:>6} | {p['ttft_mean_ms']:7.1f}/{c['ttft_mean_ms']:<7.1f} "
              f"{p['tpot_mean_ms']:6.2f}/{c['tpot_mean_ms']:<6.2f} "
              f"{p['itl_p50_ms']:6.2f}/{c['itl_p50_ms']:<6.2f} "
              f"{p['output_tok_s']:7.1f}/{c['output_tok_s']:<7.1f} | "
              f"{x['ttft_mean_ms']:5.2f} {x['tpot_mean_ms']:5.2f} {x['itl_p50_ms']:5.2f} "
              f"{x['output_tok_s']:5.2f}")
    print("(cells: PD/colocated; ratios PD / colocated: TTFT, TPOT, ITL lower is better, "
          "tok/s higher is better)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1, help="decode tp (colocated tp), default 1")
    ap.add_argument("--threads", type=int, default=1, help="ORCH_TORCH_THREADS of every rank")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8, 32],
                    help="concurrency levels (1 = unloaded, against colocated dp 1)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=8, help="timed requests per level")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    ap.add_argument("--out", type=Path, default=Path("out/serve_bench"))
    args = ap.parse_args()
    os.environ["ORCH_TORCH_THREADS"] = str(args.threads)  # inherited by orch up and Ray
    args.out.mkdir(parents=True, exist_ok=True)
    results = {dep.name: run_deployment(dep, args, args.out) for dep in deployments(args)}
    base = {**results.get("colocated-dp1", {}), **results.get("colocated-dp2", {})}
    rows = summary_rows(results["pd"], base)
    print_table(rows, args)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

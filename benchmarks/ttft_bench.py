"""TTFT before / after on this machine (issue 36): orch deployments up side by side on one
private Ray (by default `orch up configs/colocated.yaml` and `orch up configs/1p1d.yaml`,
prefill tp 1 -> decode tp 1), then `orch bench` (synthetic 256-token prompts, 64 output tokens,
2 warm-up requests) at each concurrency against each in turn, ``--rounds`` times (round r
starts at side r: the machine's load drifts); prints each report's TTFT / TPOT lines and its
TTFT breakdown (docs/performance.md, "TTFT breakdown and the first token's path"), then per
level and side the median over rounds of TTFT p50, TPOT p50 and output tok/s [range].

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ttft_bench.py --out /tmp/ttft [--rounds 2] \
        [--levels 1 8] [--side NAME=CONFIG[:KEY=VALUE,...] ...] [--ratio A/B ...]

``--side`` replaces the default sides: ``pd256=1p1d:prefill.max_num_batched_tokens=256,
prefill.chunk_size=256`` is configs/1p1d.yaml with those keys set (integers, true / false,
else strings: ``eager=1p1d:router.eager_prefill=true``,
``sock=1p1d:router.leader_calls=socket``); ``before=1p1d@/tmp/main:...`` runs the code and
configs of another checkout (e.g. ``git archive main | tar -x -C /tmp/main``), so a change is
A/B-measured in one session against its base. Every side gets 256 KV blocks a side
(colocated.yaml's 64 cap a 256 + 64 workload at 3 requests at once),
``ORCH_TORCH_THREADS=1`` and ``ORCH_RANK_NICE=0``. The reports go to ``--out`` as JSON. The
summary ends with the ``--ratio A/B`` pairs (per level, each round's TTFT p50, TPOT p50 and
output tok/s of side A over side B's in the same round), the `orch up` process's CPU per
request of each round (the router's share of the machine, warm-up requests included), and
each side's TTFT breakdown: per phase the median over every timed request of every round
(ms), and ``unseen``, the client's TTFT less the server's phases (the gRPC hops, and
whatever the router did before it opened the request or after it handed out the first
chunk).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("colocated=colocated", "1p1d=1p1d")
REQUESTS = {1: 16, 8: 32}  # concurrency -> timed requests (else 4 x concurrency)
KEPT = ("TTFT", "TPOT", "throughput", "failed")
WARMUP = 2  # warm-up requests of each replay


def parse_side(text: str) -> tuple[str, str, dict, Path]:
    """``NAME=CONFIG[@CHECKOUT][:KEY=VALUE,...]`` -> (name, config stem, {dotted key: int,
    bool or string}, checkout: this one unless given).

    Raises:
        ValueError: not of that form, or a checkout without ``configs/CONFIG.yaml``.
    """
    name, _, rest = text.partition("=")
    rest, _, sets = rest.partition(":")
    config, _, code = rest.partition("@")
    if not name or not config:
        raise ValueError(f"--side {text!r}: expected NAME=CONFIG[@CHECKOUT][:KEY=VALUE,...]")
    checkout = Path(code).resolve() if code else REPO
    if not (checkout / "configs" / f"{config}.yaml").is_file():
        raise ValueError(f"--side {text!r}: {checkout}/configs/{config}.yaml does not exist")
    over = {}
    for item in filter(None, sets.split(",")):
        key, _, value = item.partition("=")
        flags = {"true": True, "false": False}
        over[key] = flags[value.lower()] if value.lower() in flags else \
            int(value) if value.lstrip("-").isdigit() else value
    return name, config, over, checkout


def bench(address: str, name: str, conc: int, n: int, seed: int, report: Path) -> str:
    """One `orch bench` replay; its output's kept lines.

    Raises:
        subprocess.TimeoutExpired: the replay took over 10 minutes.
    """
    cmd = [sys.executable, "-m", "orchestrator.cli", "bench", "--address", address,
           "--workload", "synthetic", "--input-len", "256", "--output-len", "64",
           "--num-requests", str(n), "--warmup", str(WARMUP), "--max-concurrency", str(conc),
           "--no-progress", "--label", f"{name}-c{conc}", "--output", str(report),
           "--seed", str(seed)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    return "\n".join(line for line in (res.stdout + res.stderr).splitlines()
                     if any(k in line for k in KEPT))


def figures(report: Path) -> tuple[float, float, float]:
    """(TTFT p50 ms, TPOT p50 ms, output tok/s) of one `orch bench` JSON report."""
    data = json.loads(report.read_text())
    return data["ttft"]["p50_ms"], data["tpot"]["p50_ms"], data["output_tokens_per_s"]


def phase_rows(report: Path) -> list[dict[str, float]]:
    """Per completed timed request of one report: its TTFT phases (ms) and ``unseen``, the
    client's TTFT less their sum; [] for a report without per-request phases."""
    rows = []
    for req in json.loads(report.read_text())["requests"]:
        phases = req.get("ttft_phases_ms") or {}
        if req["ttft_ms"] is None or not phases:
            continue
        rows.append({**phases, "unseen": req["ttft_ms"] - sum(phases.values())})
    return rows


def print_breakdown(rows: dict[tuple[int, str], list[dict[str, float]]]) -> None:
    """Per level and side: each phase's median over the requests (ms)."""
    from orchestrator.router.request import TTFT_PHASES

    seen = {p for reqs in rows.values() for r in reqs for p in r}
    order = (*TTFT_PHASES, "unseen")
    names = [p for p in order if p in seen] + sorted(seen - set(order))
    print("\n| conc. | side | " + " | ".join(names) + " |\n|---|---|"
          + "---|" * len(names))
    for (conc, name), reqs in rows.items():
        cells = [f"{statistics.median(r.get(p, 0.0) for r in reqs):.2f}" for p in names]
        print(f"| {conc} | {name} | " + " | ".join(cells) + " |")


def print_summary(runs: dict[tuple[int, str], list[tuple[float, float, float]]]) -> None:
    print("\n| conc. | side | TTFT p50 ms | TPOT p50 ms | tok/s |\n|---|---|---|---|---|")
    for (conc, name), rows in runs.items():
        cells = []
        for i in range(3):
            vals = [r[i] for r in rows]
            cells.append(f"{statistics.median(vals):.1f} [{min(vals):.1f}-{max(vals):.1f}]")
        print(f"| {conc} | {name} | " + " | ".join(cells) + " |")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (every thread) used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def print_router_cpu(cpu: dict[tuple[int, str], list[float]]) -> None:
    """Per level and side: the `orch up` process's CPU (the router, its loop and Ray's
    client threads) per request of each round, ms (the clock ticks at 10 ms)."""
    for (conc, name), rounds in cpu.items():
        print(f"router CPU c={conc} {name}: " + " ".join(f"{ms:.1f}" for ms in rounds)
              + " ms per request")


def print_ratios(runs: dict[tuple[int, str], list[tuple[float, float, float]]],
                 pairs: list[str]) -> None:
    """Per ``A/B`` of ``pairs`` and level: side A's TTFT p50, TPOT p50 and output tok/s over
    side B's, round by round (a round missing a report is left out)."""
    for pair in pairs:
        a, _, b = pair.partition("/")
        for conc in sorted({c for c, _ in runs}):
            rows = list(zip(runs.get((conc, a), []), runs.get((conc, b), [])))
            cells = [" ".join(f"{x[i] / y[i]:.2f}" for x, y in rows) for i in range(3)]
            print(f"{a}/{b} c={conc} per round: TTFT p50 {cells[0]} | TPOT p50 {cells[1]} | "
                  f"tok/s {cells[2]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for configs, logs, reports")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--side", nargs="+", default=list(SIDES),
                    help="NAME=CONFIG[:KEY=VALUE,...] (CONFIG: a stem under configs/)")
    ap.add_argument("--ratio", nargs="*", default=[],
                    help="A/B: side A's figures over side B's, round by round")
    args = ap.parse_args()
    sides = [parse_side(s) for s in args.side]
    import ray

    from tests.e2e.harness import OrchProcess

    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(ORCH_TORCH_THREADS="1", ORCH_RANK_NICE="0", RAY_ADDRESS="")
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    over = {"cluster.address": ray.get_runtime_context().gcs_address,
            "cluster.bind_host": "127.0.0.1", "decode.num_kv_blocks": 256,
            "prefill.num_kv_blocks": 256}
    procs: dict[str, OrchProcess] = {}
    runs: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
    phases: dict[tuple[int, str], list[dict[str, float]]] = {}
    cpu: dict[tuple[int, str], list[float]] = {}  # router CPU ms per request, per round
    try:
        for name, config, extra, checkout in sides:
            folder = args.out / name
            folder.mkdir(exist_ok=True)
            procs[name] = OrchProcess(checkout / "configs" / f"{config}.yaml", folder,
                                      {**over, **extra}, code=checkout)
            procs[name].__enter__()
        names = list(procs)
        for r in range(args.rounds):
            for conc in args.levels:
                for name in names[r % len(names):] + names[:r % len(names)]:
                    report = args.out / f"{name}_c{conc}_r{r}.json"
                    n = REQUESTS.get(conc, 4 * conc)
                    used = cpu_s(procs[name].proc.pid)
                    lines = bench(procs[name].address, name, conc, n, r + 10 * conc, report)
                    cpu.setdefault((conc, name), []).append(
                        (cpu_s(procs[name].proc.pid) - used) * 1e3 / (n + WARMUP))
                    print(f"== {name} c={conc} round {r} (load {os.getloadavg()[0]:.1f})\n"
                          f"{lines}", flush=True)
                    if report.exists():
                        runs.setdefault((conc, name), []).append(figures(report))
                        phases.setdefault((conc, name), []).extend(phase_rows(report))
    finally:
        for orch in procs.values():
            orch.stop()
        ray.shutdown()
    print_summary(dict(sorted(runs.items())))
    print_ratios(runs, args.ratio)
    print_router_cpu(dict(sorted(cpu.items())))
    print_breakdown(dict(sorted(phases.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

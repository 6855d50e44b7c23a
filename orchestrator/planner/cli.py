"""``orch plan CONFIG --workload in=..,out=..[,rate=R|,concurrency=C[,start=together]]`` (or
``--trace FILE``).

Exit codes: 0 printed, 2 bad config, options or trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orchestrator.planner.load import WORKLOAD_HELP, WorkloadSpec, parse_workload


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``orch plan`` options (docs/planner.md)."""
    p.add_argument("config", help="YAML config (configs/...)")
    p.add_argument("--workload", default=None,
                   help=WORKLOAD_HELP + " (default closed loop filling the decode slots; "
                   "start=together: the N in lock-step, as a closed-loop bench of equal "
                   "requests runs; mtp/accept: multi-token prediction; overlap: two "
                   "micro-batches, default on for EP on an accelerator; eplb: expert load "
                   "balancer, default 1; docs/planner.md)")
    p.add_argument("--trace", type=Path, default=None,
                   help="a trace file instead: mean lengths and its arrival rate")
    p.add_argument("--trace-kind", choices=("mooncake", "azure", "sharegpt"),
                   default="mooncake", help="format of --trace (the bench's loaders)")
    p.add_argument("--device", default=None,
                   help="devices.yaml entry (a3, a2, h100, h200, h800) or cpu; default: the "
                   "config's cluster.device default")
    p.add_argument("--explain", action="store_true",
                   help="print every term of a prefill and a decode step (kernels, "
                   "all-to-all, overlap, MTP, imbalance)")
    p.add_argument("--calibrate", action="store_true",
                   help="cpu: measure again instead of using the cached figures")


def trace_workload(path: Path, kind: str) -> WorkloadSpec:
    """Mean input/output tokens of a trace (the bench's loaders) and its arrival rate.

    Raises:
        ValueError, FileNotFoundError: the bench's loaders could not read it.
    """
    from orchestrator.bench.workloads import WorkloadConfig, load_workload

    w = load_workload(WorkloadConfig(kind=kind, trace=path, num_requests=None))
    reqs = w.requests
    span = max(r.arrival_s for r in reqs)
    return WorkloadSpec(round(sum(r.input_len for r in reqs) / len(reqs)),
                        round(sum(r.output_len for r in reqs) / len(reqs)),
                        rate=len(reqs) / span if span > 0 else None)


def run(ns: argparse.Namespace) -> int:
    """Print the plan; returns the exit code."""
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.load import load_config
    from orchestrator.planner.report import format_plan, plan_config, resolve_device

    try:
        cfg = load_config(ns.config)
        if (ns.workload is None) == (ns.trace is None):
            raise ValueError("give one of --workload in=..,out=.. or --trace FILE")
        wl = (parse_workload(ns.workload) if ns.workload is not None
              else trace_workload(ns.trace, ns.trace_kind))
        device = resolve_device(cfg, ns.device, ns.calibrate)
        plan = plan_config(cfg, wl, device)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"orch plan: {exc}", file=sys.stderr)
        return 2
    print("\n".join(format_plan(plan, ns.explain)))
    return 0

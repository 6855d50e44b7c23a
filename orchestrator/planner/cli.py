"""``orch plan CONFIG --workload in=..,out=..[,rate=R|,concurrency=C[,start=together]]
[,hit=P]`` (or ``--trace FILE``: mean lengths, arrival rate and, Mooncake, the prefix-cache
hit rate of its ``hash_ids``).

Exit codes: 0 printed, 2 bad config, options or trace.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.planner.load import WORKLOAD_HELP, WorkloadSpec, parse_workload
from orchestrator.planner.prefix_hits import trace_hit_rate

if TYPE_CHECKING:
    from orchestrator.config.schema import OrchConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``orch plan`` options (docs/planner.md)."""
    p.add_argument("config", help="YAML config (configs/...)")
    p.add_argument("--workload", default=None,
                   help=WORKLOAD_HELP + " (default closed loop filling the decode slots; "
                   "start=together: the N in lock-step, as a closed-loop bench of equal "
                   "requests runs; mtp/accept: multi-token prediction; overlap: two "
                   "micro-batches, default on for EP on an accelerator; eplb: expert load "
                   "balancer, default 1; drift: the per-rank load spread EPLB leaves, "
                   "default 0.0425, 0 for perfect balance; docs/planner.md)")
    p.add_argument("--trace", type=Path, default=None,
                   help="a trace file instead: mean lengths, its arrival rate and (mooncake) "
                   "the prefix-cache hit rate of its hash_ids with the prefill KV pools as "
                   "the cache")
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


def trace_workload(path: Path, kind: str, cfg: OrchConfig | None = None
                   ) -> tuple[WorkloadSpec, str]:
    """Mean input/output tokens of a trace (the bench's loaders), its arrival rate and
    (Mooncake) its prefix-cache hit rate with the prefill KV pools of ``cfg`` as the cache
    (:func:`.prefix_hits.trace_hit_rate`; unbounded without ``cfg``); and a line saying so
    with the ideal (unbounded) rate.

    Raises:
        ValueError, FileNotFoundError: the bench's loaders could not read it.
    """
    # NOTE: orchestrator.bench needs the bench extras; orch plan without --trace does not
    from orchestrator.bench.traces import MOONCAKE_BLOCK_TOKENS, read_mooncake
    from orchestrator.bench.workloads import WorkloadConfig, load_workload

    w = load_workload(WorkloadConfig(kind=kind, trace=path, num_requests=None))
    reqs = w.requests
    span = max(r.arrival_s for r in reqs)
    wl = WorkloadSpec(round(sum(r.input_len for r in reqs) / len(reqs)),
                      round(sum(r.output_len for r in reqs) / len(reqs)),
                      rate=len(reqs) / span if span > 0 else None)
    if kind != "mooncake":
        return wl, f"trace {path}: mean in={wl.input_len} out={wl.output_len}, no hash_ids"
    ids = [e.hash_ids for e in read_mooncake(path)]
    ideal = trace_hit_rate(ids)
    blocks = None if cfg is None else cache_blocks(cfg, MOONCAKE_BLOCK_TOKENS)
    hit = ideal if blocks is None else trace_hit_rate(ids, blocks)
    cache = "unbounded" if blocks is None else \
        f"{blocks} blocks of {MOONCAKE_BLOCK_TOKENS} tokens: the prefill KV pools"
    return replace(wl, hit=hit), (
        f"trace {path}: mean in={wl.input_len} out={wl.output_len}, prefix-cache hit "
        f"{hit:.3g} with a cache of {cache} (ideal, unbounded: {ideal:.3g})")


def cache_blocks(cfg: OrchConfig, block_tokens: int) -> int:
    """``block_tokens``-token trace blocks the prefill (colocated) KV pools of all DP ranks
    hold: the prefix cache a trace replays against (an upper bound: running requests hold
    some)."""
    # NOTE: the memory plan needs torch; `orch` parses its options without it
    from orchestrator.config.memory_check import role_layouts

    return sum(lay.dp * lay.num_kv_blocks * lay.block_size // block_tokens
               for lay in role_layouts(cfg) if lay.role != "decode")


def run(ns: argparse.Namespace) -> int:
    """Print the plan; returns the exit code."""
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.load import load_config
    from orchestrator.planner.report import format_plan, plan_config, resolve_device

    try:
        cfg = load_config(ns.config, planning=True)
        if (ns.workload is None) == (ns.trace is None):
            raise ValueError("give one of --workload in=..,out=.. or --trace FILE")
        if ns.workload is not None:
            wl = parse_workload(ns.workload)
        else:
            wl, said = trace_workload(ns.trace, ns.trace_kind, cfg)
            print(said)
        device = resolve_device(cfg, ns.device, ns.calibrate)
        plan = plan_config(cfg, wl, device)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"orch plan: {exc}", file=sys.stderr)
        return 2
    print("\n".join(format_plan(plan, ns.explain)))
    return 0

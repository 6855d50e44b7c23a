"""Replay one workload against a running server and report it (`orch bench` without ``--up``,
and each deployment of ``--up``): build the workload and runner config from the parsed options,
run, print the report, the leaders' step breakdown, and write JSON / plots when asked."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from pathlib import Path

from orchestrator.api.client import resolve_token
from orchestrator.bench.report import print_kv_tail, print_report, summarize
from orchestrator.bench.runner import run_benchmark
from orchestrator.bench.records import RunnerConfig
from orchestrator.bench.workloads import (DEFAULT_TRACES, WorkloadConfig, default_trace,
                                          load_workload)

REPO_ROOT = Path(__file__).resolve().parents[2]


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """The :class:`WorkloadConfig` of parsed options.

    Raises:
        ValueError: a bad option, or no trace given and the default file is missing.
    """
    trace = args.trace
    if trace is None and args.workload in DEFAULT_TRACES:
        trace = default_trace(args.workload, REPO_ROOT)
        if trace is None:
            raise ValueError(f"no default {args.workload} trace ({DEFAULT_TRACES[args.workload]}"
                             " in ../shared/data): pass --trace PATH")
    return WorkloadConfig(
        kind=args.workload, trace=trace, num_requests=args.num_requests or None,
        warmup=args.warmup, seed=args.seed, time_scale=args.time_scale,
        request_rate=args.request_rate, arrival=args.arrival, input_len=args.input_len,
        output_len=args.output_len, scale_lengths=args.scale_lengths,
        max_input_len=args.max_input_len, max_output_len=args.max_output_len,
        over_length=args.over_length, tokenizer=args.tokenizer,
        **({"token_range": tuple(args.token_range)} if args.token_range else {}))


def replay(args: argparse.Namespace) -> int:
    """Replay the workload of ``args`` against ``args.address``; print (and write) the report.
    Returns the exit code (see module docstring)."""
    try:
        token = args.api_key or resolve_token(args.token_file)
        runner_cfg = RunnerConfig(
            address=args.address, max_concurrency=args.max_concurrency,
            request_timeout_s=args.request_timeout, connect_timeout_s=args.connect_timeout,
            label=args.label, progress=not args.no_progress, backend=args.backend,
            base_url=args.base_url, model=args.model, tls_ca=args.tls_ca, token=token)
        workload = load_workload(workload_config(args))
    except (ValueError, OSError) as e:
        print(f"orch bench: {e}", file=sys.stderr)
        return 2
    try:
        before = _step_timings(runner_cfg)
        result = asyncio.run(run_benchmark(workload, runner_cfg))
    except OSError as e:  # ConnectionError (unreachable, refused token) or an unreadable --tls-ca
        print(f"orch bench: {e}", file=sys.stderr)
        return 1
    report = summarize(result, label=args.label, workload=workload.description,
                       num_capped=workload.num_capped, num_skipped=workload.num_skipped,
                       slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    print_report(report)
    if before is not None:
        from orchestrator.bench.step_breakdown import kv_tail_of_run, print_step_breakdown

        after = _step_timings(runner_cfg)
        if after is not None:
            print_step_breakdown(before, after)
            report = replace(report, kv_tail=kv_tail_of_run(before, after))
            print_kv_tail(report)
    if args.output is not None:
        report.to_json(args.output)
    if args.plot is not None:
        from orchestrator.bench.plots import write_cdf_plots

        write_cdf_plots(report, args.plot)
    return 0 if report.counts["completed"] > 0 else 1


def _step_timings(cfg) -> dict | None:
    """The leaders' statuses (gRPC backend: step timings, kv_tail_s, MTP acceptance), None when the router
    does not say (the breakdown is then not printed; the run goes on).

    Raises:
        OSError: the router is unreachable (ConnectionError) or --tls-ca is unreadable.
    """
    if cfg.backend != "grpc":
        return None
    import grpc

    from orchestrator.bench.step_breakdown import read_statuses

    try:
        return asyncio.run(read_statuses(cfg))
    except grpc.aio.AioRpcError:
        return None

"""``orch bench``: replay a workload against a running router and report latency/throughput.

``--up CONFIG [CONFIG ...]`` brings each config up in turn and compares the reports
(:mod:`orchestrator.bench.serve`). The lead CLI mounts :func:`add_arguments` and :func:`run`
on ``bench``; ``python -m orchestrator.bench`` runs it standalone. Exit codes: 0 at least one
timed request completed, 1 nothing completed or the server was unreachable, 2 bad options or
input files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from orchestrator.bench.replay import replay
from orchestrator.bench.serve import run_configs

def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``orch bench`` option to ``parser`` (docs/bench.md describes them)."""
    g = parser.add_argument_group("server")
    g.add_argument("--address", default="127.0.0.1:50051", help="router host:port (gRPC)")
    g.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="grpc: orch's Generate at --address; openai: streamed /completions "
                   "of any OpenAI-compatible server at --base-url")
    g.add_argument("--base-url", default=None,
                   help="with --backend openai: the API base, e.g. http://127.0.0.1:8000/v1")
    g.add_argument("--model", default=None,
                   help="with --backend openai: model name (default: the first of GET /models)")
    g.add_argument("--tls-ca", metavar="PEM", default=None,
                   help="CA (or self-signed certificate) PEM to trust: a router with "
                   "router.tls, or an https --base-url")
    g.add_argument("--token-file", metavar="FILE", default=None,
                   help="file holding the bearer token of a router with router.auth, sent by "
                   "both backends (default: $ORCH_TOKEN)")
    g.add_argument("--api-key", default=None,
                   help="with --backend openai: the bearer token itself (instead of "
                   "--token-file)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: unbounded)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="per request, seconds")
    g.add_argument("--connect-timeout", type=float, default=10.0, help="seconds")
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", choices=("mooncake", "azure", "sharegpt", "synthetic"),
                   default="synthetic")
    g.add_argument("--trace", type=Path, default=None,
                   help="trace file (default: ../shared/data/<public file> when present)")
    g.add_argument("--num-requests", type=int, default=100,
                   help="timed requests; 0 = the whole trace")
    g.add_argument("--warmup", type=int, default=0, help="warm-up requests, not measured")
    g.add_argument("--seed", type=int, default=0, help="prompt tokens and Poisson arrivals")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="factor on arrival times (0.1 = 10x faster)")
    g.add_argument("--request-rate", type=_rate, default=None,
                   help="requests/s replacing the trace's times ('inf' = all at once)")
    g.add_argument("--arrival", choices=("poisson", "fixed"), default="poisson",
                   help="arrival process for --request-rate")
    g.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens")
    g.add_argument("--output-len", type=int, default=128,
                   help="synthetic and ShareGPT output tokens")
    g.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer.json counting ShareGPT prompt tokens (default DeepSeek-V3)")
    g.add_argument("--token-range", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                   help="prompt token ids of traces/synthetic come from [LOW, HIGH) "
                   "(default 1000 100000; keep HIGH <= the model's vocab size)")
    g = parser.add_argument_group("length caps")
    g.add_argument("--scale-lengths", type=float, default=1.0,
                   help="factor on trace lengths (e.g. 0.01 for a tiny model)")
    g.add_argument("--max-input-len", type=int, default=None)
    g.add_argument("--max-output-len", type=int, default=None)
    g.add_argument("--over-length", choices=("cap", "skip"), default="cap")
    g = parser.add_argument_group("report")
    g.add_argument("--slo-ttft-ms", type=float, default=None)
    g.add_argument("--slo-tpot-ms", type=float, default=None)
    g.add_argument("--output", type=Path, default=None, help="write the report as JSON")
    g.add_argument("--plot", type=Path, default=None, help="write TTFT/TPOT CDF PNGs here")
    g.add_argument("--label", default="bench", help="run name (request ids, report, plots)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"),
                   help="print two reports side by side with B/A ratios, then exit")
    g = parser.add_argument_group("bring-up (compare deployments)")
    g.add_argument("--up", nargs="+", metavar="CONFIG", default=None,
                   help="`orch up` each config in turn on free loopback ports, replay against "
                   "it, stop it; then compare the first (A) with each later one (B)")
    g.add_argument("--up-out", type=Path, default=Path("out/bench"),
                   help="with --up: where reports (<config stem>.json) and `orch up` logs go")
    g.add_argument("--up-startup-timeout", type=float, default=300.0,
                   help="with --up: seconds each `orch up` gets to start serving")


def run(args: argparse.Namespace) -> int:
    """Run ``orch bench`` with parsed options; returns the exit code (see module docstring)."""
    if args.compare:
        from orchestrator.bench.compare import print_comparison

        try:
            print_comparison(*args.compare)
        except (ValueError, FileNotFoundError) as e:
            print(f"orch bench: {e}", file=sys.stderr)
            return 2
        return 0
    if args.up:
        if args.backend != "grpc":
            print("orch bench: --up replays over gRPC only: drop --backend openai, or start "
                  "the server yourself and pass --base-url", file=sys.stderr)
            return 2
        return run_configs(args)
    return replay(args)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: parse ``argv`` and :func:`run`."""
    parser = argparse.ArgumentParser(prog="python -m orchestrator.bench",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))

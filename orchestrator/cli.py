"""The `orch` command: up, status, generate, scale, model init-tiny, bench, plan.

Exit codes: 0 ok, 1 runtime failure, 2 bad config or arguments, 3 (`orch status`) the
router answered but some instance is not healthy, 141 its output's reader went away
(`orch status | head`), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from orchestrator.api.client import OrchClient
    from orchestrator.config.schema import OrchConfig

DEFAULT_ADDRESS = "127.0.0.1:50051"
EXIT_UNHEALTHY = 3
EXIT_BROKEN_PIPE = 141  # NOTE: 128 + SIGPIPE, what a shell reports for a writer killed by it


def _cmd_up(ns: argparse.Namespace) -> int:
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.load import load_config

    flags = {"router.host": ns.host, "router.port": ns.port,
             "router.metrics_host": ns.metrics_host, "router.metrics_port": ns.metrics_port,
             "router.http_port": ns.http_port}
    try:
        cfg = load_config(ns.config, {k: v for k, v in flags.items() if v is not None},
                          planning=ns.dry_run)
    except ConfigError as exc:
        print(f"orch up: {exc}", file=sys.stderr)
        return 2
    if ns.dry_run:
        return _dry_run(cfg)
    from orchestrator.deploy.rank_actors import BringUpError
    from orchestrator.api.server import PortInUseError
    from orchestrator.up import run_up

    try:
        return run_up(cfg)
    except ConfigError as exc:
        print(f"orch up: {exc}", file=sys.stderr)
        return 2
    except (BringUpError, FileNotFoundError, ImportError, PortInUseError) as exc:
        print(f"orch up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("orch up: interrupted (Ctrl-C or SIGTERM); stopped what had started",
              file=sys.stderr)
        return 130


def _dry_run(cfg: OrchConfig) -> int:
    """Print the `orch up --dry-run` report; 2 when the memory plan does not fit, or (after
    the plan) when DeepSeek-V4 serving refuses the layout."""
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.memory_check import check_memory
    from orchestrator.deploy.placement import dry_run_report, v4_refusal
    from orchestrator.planner.report import dry_run_lines

    try:
        print(dry_run_report(cfg), flush=True)
        print(check_memory(cfg))
        for line in dry_run_lines(cfg):
            print(line)
        refusal = v4_refusal(cfg)  # NOTE: a V4 layout serving refuses: planned, then refused
        if refusal is not None:
            raise refusal
    except ConfigError as exc:
        print(f"orch up: {exc}", file=sys.stderr)
        return 2
    return 0


def _client(ns: argparse.Namespace) -> OrchClient:
    """The OrchClient of ``--address``, ``--tls-ca`` and ``--token-file`` (else $ORCH_TOKEN).

    Raises:
        OSError: ``--tls-ca`` or ``--token-file`` cannot be read.
    """
    from orchestrator.api.client import OrchClient, resolve_token

    return OrchClient(ns.address, tls_ca=ns.tls_ca, token=resolve_token(ns.token_file))


def _rpc_failure(ns: argparse.Namespace, exc: grpc.RpcError) -> str:
    """One line for a failed call: code, details and, when the router was not reached, what
    to check."""
    line = f"{exc.code().name}: {exc.details()}"
    # NOTE: an UNAVAILABLE the router itself sent (an instance failed) reached the router
    unreached = any(word in (exc.details() or "").lower()
                    for word in ("failed to connect", "connection", "handshake", "ssl", "dns"))
    if exc.code().name == "UNAVAILABLE" and unreached:
        tls = ("a router with router.tls needs --tls-ca FILE" if ns.tls_ca is None else
               f"is the router's certificate signed by {ns.tls_ca} and valid for this address?")
        line += f"; is `orch up` running at {ns.address}? ({tls})"
    return line


def _cmd_status(ns: argparse.Namespace) -> int:
    import grpc

    try:
        with _client(ns) as client:
            instances, in_flight, model = client.status(timeout_s=ns.timeout)
    except OSError as exc:
        print(f"orch status: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"orch status: {_rpc_failure(ns, exc)}", file=sys.stderr)
        return 1
    print(f"model {model}; {in_flight} request(s) in flight")
    print(format_status(instances))
    sick = [v.name for v in instances if not v.healthy]
    if sick:
        print(f"capacity: {format_capacity(instances)}")
        print(f"orch status: not healthy: {', '.join(sick)}", file=sys.stderr)
        return EXIT_UNHEALTHY
    return 0


def format_capacity(instances: list) -> str:
    """Healthy instances per role, e.g. "decode 1/2 healthy (reduced), prefill 1/1 healthy";
    a role with none says it cannot serve."""
    parts = []
    for role in dict.fromkeys(v.role for v in instances):
        rows = [v for v in instances if v.role == role]
        healthy = sum(v.healthy for v in rows)
        mark = (" (none: requests get UNAVAILABLE / HTTP 503)" if not healthy else
                " (reduced)" if healthy < len(rows) else "")
        parts.append(f"{role} {healthy}/{len(rows)} healthy{mark}")
    return ", ".join(parts)


def format_status(instances: list) -> str:
    """The instance table of `orch status` (rows: ``orchestrator.status.InstanceView``).

    Load columns read "-" when the instance was not asked or did not answer; ``detail`` says
    why it is not healthy or why its load is missing. ``tokens``: what the instance still has
    to process (its scheduler); ``routed``: tokens the answering router replica placed there
    and has not released (its policy's load, known whether or not the instance answered);
    ``cached``: prefix-cache blocks held; ``hit``: prompt tokens found cached / looked up
    since the instance started. A DeepSeek-V4 instance gets a line of its KV groups' free /
    total blocks.
    """
    lines = [f"{'instance':<14}{'role':<11}{'tp':>3}  {'health':<11}{'queue':>6}"
             f"{'running':>9}{'free/total blocks':>19}{'tokens':>9}{'routed':>9}{'cached':>8}"
             f"{'hit':>7}  detail"]
    for v in instances:
        s = v.status
        load = ((s.queue_depth, s.running, f"{s.free_blocks}/{s.total_blocks}",
                 s.outstanding_tokens, s.cached_blocks, f"{100 * s.prefix_hit_rate:.0f}%")
                if s else ("-",) * 6)
        lines.append(f"{v.name:<14}{v.role:<11}{v.tp:>3}  {v.health:<11}{load[0]:>6}"
                     f"{load[1]:>9}{load[2]:>19}{load[3]:>9}{v.router_tokens:>9}{load[4]:>8}"
                     f"{load[5]:>7}  {v.detail}".rstrip())
        if s and s.kv_groups:
            lines.append("    V4 KV groups free/total blocks: " + ", ".join(
                f"{group} {free}/{total}" for group, free, total in s.kv_groups))
        if s and s.graph_modes:
            lines.append("    graph: " + "; ".join(f"{forward} {state}"
                                                   for forward, state in s.graph_modes))
        if s and s.spec_mean_accepted_length:
            lines.append(f"    MTP: acceptance {s.spec_acceptance_rate:.2f}, "
                         f"{s.spec_mean_accepted_length:.2f} tokens per verify step")
        for rank, node, device, pid in (s.ranks if s else ()):
            lines.append(f"    rank {rank}: node {node[:12]} device {device} pid {pid}")
        if s and s.kv_tail.count:
            t = s.kv_tail
            lines.append(f"    kv_tail_s (prefill forward end -> every cell here): "
                         f"{t.count} requests, mean {t.sum_s / t.count * 1e3:.2f} ms, max "
                         f"{t.max_s * 1e3:.2f} ms, last {t.last_s * 1e3:.2f} ms")
    return "\n".join(lines)


def _cmd_generate(ns: argparse.Namespace) -> int:
    import grpc

    sampling = dict(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                    top_k=ns.top_k, seed=ns.seed, ignore_eos=ns.ignore_eos,
                    stop=tuple(ns.stop or ()))
    if ns.token_ids:
        try:
            prompt = dict(token_ids=[int(t) for t in ns.prompt.replace(",", " ").split()])
        except ValueError:
            print(f"orch generate: --token-ids needs integers separated by commas or spaces "
                  f"(e.g. '1,2,3'), got {ns.prompt!r}", file=sys.stderr)
            return 2
    else:
        prompt = dict(prompt=ns.prompt)
    ids: list[int] = []
    printed = False  # text on stdout not yet ended by a newline
    try:
        with _client(ns) as client:
            for chunk in client.generate(**prompt, timeout_s=ns.timeout, **sampling):
                ids.extend(chunk.token_ids)
                print(chunk.text, end="", flush=True)
                printed = printed or bool(chunk.text)
                last = chunk
    except OSError as exc:
        print(f"orch generate: {exc}", file=sys.stderr)
        return 2
    except (grpc.RpcError, ValueError) as exc:
        detail = _rpc_failure(ns, exc) if isinstance(exc, grpc.RpcError) else exc
        if printed:
            print(flush=True)  # NOTE: the error never shares a line with streamed text
        print(f"orch generate: {detail}", file=sys.stderr)
        return 1
    print()
    if ns.token_ids:
        print(f"token ids: {ids}")
    sys.stdout.flush()  # NOTE: the stats (stderr) come after the output, also in one pipe
    s = last.stats
    print(f"[{last.finish_reason}] prompt {s.prompt_tokens} tok, completion "
          f"{s.completion_tokens} tok, ttft {s.ttft_s * 1e3:.1f} ms, tpot "
          f"{s.tpot_s * 1e3:.1f} ms, e2e {s.e2e_s:.3f} s", file=sys.stderr)
    return 0


def _run_model_tool(command: str, module: str, name: str, args: tuple,
                    errors: tuple[type[Exception], ...]) -> int:
    """``orch model COMMAND``: call ``module.name(*args)`` (it prints what it wrote); exit 1
    when the engine is not installed, 2 on one of ``errors`` (bad arguments, a used folder)."""
    try:
        import importlib  # noqa: PLC0415 (the engine only when a model tool runs)

        tool = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        print(f"orch model {command}: the engine is not installed ({exc})", file=sys.stderr)
        return 1
    try:
        tool(*args)
    except errors as exc:
        print(f"orch model {command}: {exc}", file=sys.stderr)
        return 2
    return 0


def _cmd_init_tiny(ns: argparse.Namespace) -> int:
    # ValueError: unknown --arch, DIR not new or empty
    return _run_model_tool("init-tiny", "orchestrator.tiny_model", "init_tiny_main",
                           (ns.dir, ns.seed, ns.arch), (ValueError,))


def _cmd_quantize(ns: argparse.Namespace) -> int:
    # OSError / ValueError: missing source, used destination, bad arguments
    return _run_model_tool("quantize", "engine.quant.writer", "quantize_main",
                           (ns.src, ns.dst, ns.scheme, ns.shard_mb), (OSError, ValueError))


def _add_bench(sub: argparse._SubParsersAction) -> None:
    help_text = "benchmark a running router"
    try:
        from orchestrator.bench.cli import add_arguments, run
    except ImportError as exc:
        missing = str(exc)
        # NOTE: no option prefix, so every argument (`--num-requests 3` too) lands in `rest`
        # and the command says what is missing instead of "unrecognized arguments".
        bench = sub.add_parser("bench", help=help_text, prefix_chars="\0", add_help=False)
        bench.add_argument("rest", nargs="*")
        bench.set_defaults(func=lambda ns: _missing_bench(missing))
        return
    bench = sub.add_parser("bench", help=help_text)
    add_arguments(bench)
    bench.set_defaults(func=run)


def _missing_bench(reason: str) -> int:
    print(f"orch bench: the benchmark package is not installed ({reason}); install the full "
          "orch package (orchestrator/bench)", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orch", description="PD-disaggregated serving")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start instances + router from a config file")
    up.add_argument("config", help="YAML config (see configs/ and docs/config.md)")
    up.add_argument("--dry-run", action="store_true",
                    help="validate and print placement + transfer plans; start nothing")
    up.add_argument("--host", help="listen address of the router (router.host)")
    up.add_argument("--port", type=int, help="gRPC port of the router (router.port)")
    up.add_argument("--metrics-host", help="listen address of /metrics (router.metrics_host)")
    up.add_argument("--metrics-port", type=int,
                    help="Prometheus /metrics port (router.metrics_port)")
    up.add_argument("--http-port", type=int,
                    help="OpenAI-compatible HTTP API port (router.http_port)")
    up.set_defaults(func=_cmd_up)
    for name, func, text in (("status", _cmd_status, "instances and ranks of a router"),
                             ("generate", _cmd_generate, "stream one completion")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--address", default=None,
                       help=f"router host:port (default {DEFAULT_ADDRESS})")
        p.add_argument("--port", dest="router_port", type=int, default=None,
                       help="router port on 127.0.0.1, as given to `orch up --port` "
                            "(shorthand for --address 127.0.0.1:PORT)")
        p.add_argument("--timeout", type=float, default=None if name == "generate" else 10.0,
                       help="seconds before giving up")
        p.add_argument("--tls-ca", metavar="FILE", default=None,
                       help="PEM CA (or self-signed certificate) of a router with router.tls")
        p.add_argument("--token-file", metavar="FILE", default=None,
                       help="file holding the bearer token of a router with router.auth "
                            "(default: $ORCH_TOKEN)")
        p.set_defaults(func=func)
        if name == "generate":
            _add_generate_args(p)
    from orchestrator.api import scale_cli  # NOTE: lazy, as plan's: `orch --help` stays fast
    scale_cli.add_scale_parser(sub)
    model = sub.add_parser("model", help="checkpoint tools").add_subparsers(
        dest="model_command", required=True)
    tiny = model.add_parser("init-tiny", help="write the built-in tiny checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", default="deepseek_v3",
                      help="model_type: deepseek_v3 (default), deepseek_v32 (sparse attention), "
                      "glm_moe_dsa (GLM-5), glm_moe_dsa_shared (GLM-5.2: shared indexer layers) or "
                      "deepseek_v4 (sliding window + compressed attention, mHC)")
    tiny.set_defaults(func=_cmd_init_tiny)
    quant = model.add_parser("quantize", help="write an FP8-block or int8 W8A8 checkpoint "
                             "from a float one (docs/quantization.md)")
    quant.add_argument("src")
    quant.add_argument("dst")
    quant.add_argument("--scheme", required=True, choices=("fp8-block", "w8a8"))
    quant.add_argument("--shard-mb", type=int, default=5120, help="largest output file, MiB")
    quant.set_defaults(func=_cmd_quantize)
    _add_bench(sub)
    from orchestrator.planner import cli as plan_cli

    plan = sub.add_parser("plan", help="predict TTFT, TPOT and tokens/s of a config "
                          "(docs/planner.md)")
    plan_cli.add_arguments(plan)
    plan.set_defaults(func=plan_cli.run)
    return parser


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text (or token ids with --token-ids)")
    p.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids ('1,2,3'); also print the output ids")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop string (repeat for several): the text ends before it")


def main(argv: list[str] | None = None) -> int:
    """Run one command; exit code as in the module docstring, 130 on Ctrl-C (one line, no
    traceback, whenever it comes: commands that start processes stop them first)."""
    try:
        from orchestrator.logs import setup_logging

        setup_logging()
        parser = build_parser()
        ns = parser.parse_args(argv)
        if getattr(ns, "router_port", None) is not None:
            if ns.address is not None:
                parser.error("give --address HOST:PORT or --port PORT, not both")
            ns.address = f"127.0.0.1:{ns.router_port}"
        elif hasattr(ns, "address") and ns.address is None:
            ns.address = DEFAULT_ADDRESS
        return ns.func(ns)
    except BrokenPipeError:
        # NOTE: the reader of stdout went away (`orch status | head`): stop as a command
        # killed by SIGPIPE would, without a traceback; stdout goes to /dev/null so the
        # interpreter's flush at exit cannot fail again (Python's documented recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        command = " ".join(["orch"] + (sys.argv[1:2] if argv is None else argv[:1]))
        print(f"{command}: interrupted (Ctrl-C or SIGTERM)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

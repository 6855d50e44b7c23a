"""`orch scale CONFIG ROLE=N ...`: resize a running deployment through its Admin service.

``ROLE=N`` sets a role's instance count, ``ROLE=+N`` / ``ROLE=-N`` changes it (from what
`GetStatus` lists now, draining instances aside). The router's address and token come from
CONFIG (``router.host``/``router.port``, ``router.auth``) unless ``--address`` /
``--token-file`` say otherwise; a router with ``router.tls`` needs ``--tls-ca``. Returns once
added instances serve and removed ones are gone (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import sys
import time



def parse_targets(args: list[str], current: dict[str, int]) -> dict[str, int]:
    """``["prefill=3", "decode=+1"]`` -> role -> instance count (``+n``/``-n``: relative to
    ``current``, role -> its count now).

    Raises:
        ValueError: not ``ROLE=N``, ``ROLE=+N`` or ``ROLE=-N``; an unknown role; below 1.
    """
    out: dict[str, int] = {}
    for arg in args:
        role, _, value = arg.partition("=")
        if role not in current or not value.lstrip("+-").isdigit():
            raise ValueError(f"{arg!r}: write ROLE=N, ROLE=+N or ROLE=-N with ROLE one of "
                             f"{sorted(current)}")
        if role in out:
            raise ValueError(f"{arg!r}: {role} is named twice; give each role once")
        count = current[role] + int(value) if value[0] in "+-" else int(value)
        if count < 1:
            raise ValueError(f"{arg!r}: {role} has {current[role]} instance(s) now, so this "
                             f"leaves {count}; a role keeps at least 1")
        out[role] = count
    return out


def add_scale_parser(sub: argparse._SubParsersAction) -> None:
    """The ``scale`` subcommand of `orch`."""
    p = sub.add_parser("scale", help="add or remove instances of a running deployment")
    p.add_argument("config", help="the YAML config `orch up` runs")
    p.add_argument("targets", nargs="+", metavar="ROLE=N",
                   help="prefill=3, decode=+1, decode=-1, ... (colocated=N in colocated mode)")
    p.add_argument("--address", dest="scale_address", default=None,
                   help="router host:port (default: router.host:router.port of CONFIG)")
    p.add_argument("--port", dest="scale_port", type=int, default=None,
                   help="router port on 127.0.0.1 (an `orch up --port` deployment)")
    p.add_argument("--tls-ca", metavar="FILE", default=None,
                   help="PEM CA of a router with router.tls")
    p.add_argument("--token-file", metavar="FILE", default=None,
                   help="bearer token file (default: router.auth of CONFIG, else $ORCH_TOKEN)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds before giving up (starting an instance loads the model)")
    p.set_defaults(func=run_scale)


def run_scale(ns: argparse.Namespace) -> int:
    """Exit 0 when done, 1 when the router refused or failed, 2 for bad arguments."""
    # NOTE: lazy, as the other commands': `orch --help` imports neither torch nor grpc
    import grpc

    from orchestrator.api.client import OrchClient, resolve_token
    from orchestrator.api.security import configured_token
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.load import load_config

    try:
        cfg = load_config(ns.config)
        token = resolve_token(ns.token_file) if ns.token_file else (
            configured_token(cfg.router) or resolve_token(None))
    except (ConfigError, OSError) as exc:
        print(f"orch scale: {exc}", file=sys.stderr)
        return 2
    host = "127.0.0.1" if cfg.router.host in ("0.0.0.0", "") else cfg.router.host
    address = ns.scale_address or (f"127.0.0.1:{ns.scale_port}" if ns.scale_port else
                                   f"{host}:{cfg.router.port}")
    started = time.monotonic()
    try:
        with OrchClient(address, tls_ca=ns.tls_ca, token=token) as client:
            rows, _, _ = client.status(timeout_s=30)
            current: dict[str, int] = {}
            for row in rows:
                current[row.role] = current.get(row.role, 0) + (row.health != "draining")
            counts = parse_targets(ns.targets, current)
            reply = client.scale(counts, timeout_s=ns.timeout)
    except ValueError as exc:
        print(f"orch scale: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"orch scale: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    print(f"added {', '.join(reply.added) or 'none'}; removed {', '.join(reply.removed) or 'none'}"
          f" ({reply.moved_requests} request(s) moved away); now "
          f"{', '.join(f'{r}={n}' for r, n in sorted(reply.counts.items()))} in {took:.1f} s")
    return 0

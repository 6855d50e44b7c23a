"""``orch bench --up CONFIG [CONFIG ...]``: bring each config up in turn, replay the same
workload against it, stop it, and compare the reports.

Each ``orch up`` runs as a subprocess on free loopback ports (router and metrics ports
replaced); SIGINT drains it before the next config starts. Reports land in ``--up-out`` as
``<config stem>.json`` beside the ``orch up`` log; the comparison prints the first config (A)
against each later one (B), B/A.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from orchestrator.bench.replay import replay

# Seconds `orch up` gets to drain and stop after SIGINT before its process group is killed.
STOP_TIMEOUT_S = 120.0
# Seconds between checks that `orch up` still runs while waiting for it to serve.
_READY_SLICE_S = 2.0


@dataclass(frozen=True)
class ServedConfig:
    """One config's replay: its YAML file, JSON report and exit code (0: at least one timed
    request completed)."""

    config: Path
    report: Path
    exit_code: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_on_free_ports(config: Path, directory: Path) -> tuple[Path, int]:
    """A copy of ``config`` in ``directory`` whose router listens on a free loopback port (and
    metrics too, when the config has a metrics port); returns (path, router port).

    Raises:
        FileNotFoundError: ``config`` does not exist.
        ValueError: ``config`` is not a YAML mapping.
    """
    data = yaml.safe_load(config.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{config}: not a YAML mapping; pass an `orch up` config file")
    port = _free_port()
    router = {**(data.get("router") or {}), "host": "127.0.0.1", "port": port}
    if router.get("metrics_port") is not None:
        router["metrics_port"] = _free_port()
    data["router"] = router
    path = directory / config.name
    path.write_text(yaml.safe_dump(data))
    return path, port


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT (graceful drain), then SIGKILL of the process group after ``STOP_TIMEOUT_S``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def serving(config: Path, out: Path, startup_timeout_s: float) -> Iterator[str]:
    """``orch up config`` on free loopback ports (log in ``out/<stem>.up.log``), serving for
    the body of the ``with``; yields the router address; stopped (drained) on exit.

    Raises:
        FileNotFoundError, ValueError: ``config`` is missing or not a YAML mapping.
        TimeoutError: the router was not SERVING within ``startup_timeout_s`` seconds (the
            ``orch up`` log path is in the message).
        RuntimeError: ``orch up`` exited before serving.
    """
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, port = _config_on_free_ports(config, Path(tmp))
        log_path = out / f"{config.stem}.up.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up",
                                     str(cfg_path)], stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            _wait_serving(proc, port, startup_timeout_s, f"orch up {config}", log_path)
            yield f"127.0.0.1:{port}"
        finally:
            _stop(proc)


def _wait_serving(proc: subprocess.Popen, port: int, timeout_s: float, what: str,
                  log_path: Path) -> None:
    """Wait until the router on ``port`` is SERVING, checking every ``_READY_SLICE_S`` that
    ``proc`` still runs.

    Raises:
        RuntimeError: ``proc`` exited first. TimeoutError: not SERVING within ``timeout_s``.
    """
    from orchestrator.api.client import OrchClient

    deadline = time.monotonic() + timeout_s
    with OrchClient(f"127.0.0.1:{port}") as client:
        while True:
            try:
                client.wait_ready(min(_READY_SLICE_S, max(0.1, deadline - time.monotonic())))
                return
            except TimeoutError as exc:
                if proc.poll() is not None:
                    raise RuntimeError(f"{what} exited with {proc.returncode} before serving; "
                                       f"see {log_path}") from exc
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{what} not serving within {timeout_s:g} s; see "
                                       f"{log_path}") from exc


def serve_and_replay(config: Path, args: argparse.Namespace, out: Path) -> ServedConfig:
    """``orch up config`` on free ports (:func:`serving`), the replay of ``args`` against it,
    then stop it; raises as :func:`serving`."""

    with serving(config, out, args.up_startup_timeout) as address:
        report = out / f"{config.stem}.json"
        run_args = argparse.Namespace(**{**vars(args), "address": address,
                                         "label": config.stem, "output": report})
        return ServedConfig(config, report, replay(run_args))


def run_configs(args: argparse.Namespace) -> int:
    """Replay ``args`` against every config of ``args.up`` in turn, then compare.

    Returns 0 when every replay completed at least one timed request, else 1; 2 for a config
    that could not be read.
    """
    from orchestrator.bench.compare import print_comparison

    out = Path(args.up_out)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[ServedConfig] = []
    for config in args.up:
        try:
            runs.append(serve_and_replay(Path(config), args, out))
        except (FileNotFoundError, ValueError, yaml.YAMLError) as exc:
            print(f"orch bench: {exc}", file=sys.stderr)
            return 2
        except (TimeoutError, RuntimeError) as exc:
            print(f"orch bench: {exc}", file=sys.stderr)
            return 1
    for later in runs[1:]:
        print_comparison(runs[0].report, later.report)
    return 0 if all(r.exit_code == 0 for r in runs) else 1

"""PD vs colocated on the same trace replay, in one session: `orch up` each config in turn
(as a subprocess, free ports), `orch bench` against it, then `orch bench --compare`.

    .venv/bin/python benchmarks/serve_bench.py --out out/serve \
        -- --workload azure --num-requests 30 --scale-lengths 0.1 --max-input-len 400 \
           --max-output-len 48

Everything after ``--`` goes to `orch bench` (workload, caps, SLOs). Reports land in
``--out`` as ``<config stem>.json``; the comparison prints colocated (A) vs PD (B) with B/A.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from orchestrator.client import OrchClient

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(config: Path, bench_args: list[str], out: Path, startup_s: float) -> Path:
    """`orch up config` on free ports, `orch bench` against it, stop it; the report path."""
    data = yaml.safe_load(config.read_text())
    port = _free_port()
    data["router"] = {**data.get("router", {}), "port": port, "host": "127.0.0.1"}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = Path(tmp) / config.name
        cfg_path.write_text(yaml.safe_dump(data))
        log = (out / f"{config.stem}.up.log").open("w")
        up = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up",
                               str(cfg_path)], stdout=log, stderr=subprocess.STDOUT,
                              cwd=REPO, start_new_session=True)
        try:
            with OrchClient(f"127.0.0.1:{port}") as client:
                client.wait_ready(startup_s)
            report = out / f"{config.stem}.json"
            subprocess.run([sys.executable, "-m", "orchestrator.cli", "bench",
                            "--address", f"127.0.0.1:{port}", "--label", config.stem,
                            "--output", str(report), "--no-progress", *bench_args],
                           check=True, cwd=REPO)
            return report
        finally:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="configs/colocated.yaml")
    parser.add_argument("--candidate", default="configs/1p1d.yaml")
    parser.add_argument("--out", default="out/serve")
    parser.add_argument("--startup-s", type=float, default=300.0)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args()
    bench_args = [a for a in ns.bench_args if a != "--"]
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    a = run_config(REPO / ns.baseline, bench_args, out, ns.startup_s)
    b = run_config(REPO / ns.candidate, bench_args, out, ns.startup_s)
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "bench",
                           "--compare", str(a), str(b)], cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())

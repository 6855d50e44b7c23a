"""CPU of everything but the ranks, per streamed output token, on a 1P1D layout.

``orch up`` runs configs/1p1d.yaml with decode tp 1 and 32 sequences (the built-in tiny model,
embedded Ray); the bench client (this process, not counted) sends ``--requests`` requests of
``--input-len`` random prompt tokens and exactly ``--output-len`` output tokens (greedy, EOS
ignored), ``c`` at a time, per level:

- ``c4``, ``c32``: 4 / 32 in flight, decode has room for all;
- ``queue``: 64 in flight, decode KV for 32 (``num_kv_blocks``), so 32 wait in the router's
  admission queue the whole run.

One ``orch up`` serves every level (decode KV sized for exactly 32 requests).

Counted: user + system CPU seconds (``/proc/<pid>/stat``) of the ``orch up`` process and every
descendant (router, Ray's gcs / raylet / dashboard, idle Ray workers) except the rank processes
(``GetStatus`` names their pids), from the first timed request to the last token; divided by
the output tokens streamed. ``--repo`` runs ``orch up`` from another checkout (the baseline:
``git worktree add /tmp/base <commit>``), with the same client and layout.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/router_cpu_bench.py [--levels c4 c32 queue]
     [--repo /path/to/other/checkout]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from orchestrator.api.client import AsyncOrchClient
from orchestrator.bench.serve import _config_on_free_ports, _stop, _wait_serving

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
BLOCK = 16
LEVELS = {"c4": 4, "c32": 32, "queue": 64}  # level -> requests in flight
ROOM = 32  # requests decode KV is sized for


def _config(args: argparse.Namespace, room: int, inflight: int, directory: Path) -> Path:
    data = yaml.safe_load((REPO / "configs" / "1p1d.yaml").read_text())
    per_request = -(-(args.input_len + args.output_len) // BLOCK)
    data["decode"].update(tp=1, max_num_seqs=32, num_kv_blocks=room * per_request)
    data["prefill"].update(max_num_seqs=32, num_kv_blocks=max(64, 2 * per_request))
    data["router"].update(max_pending=max(64, inflight), metrics_port=None,
                          request_timeout_s=600)
    path = directory / "router_cpu.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry))
    return tree


def _name(pid: int) -> str:
    """What a process of the tree is: "orch up", "raylet", "gcs_server", ... ."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    text = b" ".join(argv).decode(errors="replace")
    if "orchestrator.cli" in text:
        return "orch up"
    for known in ("raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env",
                  "ray_watchdog", "autoscaler", "default_worker"):
        if known in text:
            return known
    return argv[0].decode(errors="replace").split("/")[-1] or "?"


def _tree_cpu(root: int, skip: set[int]) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds) of ``root`` and its descendants, without ``skip``."""
    tree, out, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, ()))
        if pid in skip:
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (_name(pid), (int(fields[11]) + int(fields[12])) / TICK)
    return out


async def _drive(address: str, args: argparse.Namespace, inflight: int) -> int:
    """Send the requests, ``inflight`` at a time; output tokens streamed."""
    client = AsyncOrchClient(address)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(args.input_len)]
               for _ in range(args.requests)]
    sem = asyncio.Semaphore(inflight)

    async def one(prompt: list[int]) -> int:
        async with sem:
            n = 0
            async for chunk in client.generate(token_ids=prompt, max_tokens=args.output_len,
                                               ignore_eos=True, temperature=0.0,
                                               timeout_s=600):
                n += len(chunk.token_ids)
            return n
    try:
        return sum(await asyncio.gather(*(one(p) for p in prompts)))
    finally:
        await client.close()


async def _rank_pids(address: str) -> set[int]:
    client = AsyncOrchClient(address)
    try:
        views, _, _ = await client.status()
    finally:
        await client.close()
    return {pid for v in views if v.status for _, _, _, pid in v.status.ranks}


def run_levels(args: argparse.Namespace) -> list[tuple[str, float, int, float]]:
    """(level, CPU ms per output token, output tokens, seconds, by process name) of each
    level."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg, port = _config_on_free_ports(_config(args, ROOM, max(LEVELS.values()), Path(tmp)),
                                          Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(args.repo)}
        log_path = args.out / "router_cpu.up.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", str(cfg)],
                                    stdout=log, stderr=subprocess.STDOUT, cwd=args.repo,
                                    env=env, start_new_session=True)
        try:
            _wait_serving(proc, port, 600, "orch up", log_path)
            address = f"127.0.0.1:{port}"
            ranks = asyncio.run(_rank_pids(address))
            asyncio.run(_warm(address, args))
            return [(level, *_measure(proc.pid, ranks, address, args, LEVELS[level]))
                    for level in args.levels]
        finally:
            _stop(proc)


def _measure(pid: int, ranks: set[int], address: str, args: argparse.Namespace,
             inflight: int) -> tuple[float, int, float, dict[str, float]]:
    """(CPU ms per token, tokens, seconds, process name -> CPU ms per token)."""
    before, t0 = _tree_cpu(pid, ranks), time.perf_counter()
    tokens = asyncio.run(_drive(address, args, inflight))
    seconds = time.perf_counter() - t0
    after = _tree_cpu(pid, ranks)
    by_name: dict[str, float] = {}
    for p, (name, cpu) in after.items():
        spent = cpu - before.get(p, (name, 0.0))[1]
        by_name[name] = by_name.get(name, 0.0) + 1e3 * spent / max(tokens, 1)
    return sum(by_name.values()), tokens, seconds, by_name


async def _warm(address: str, args: argparse.Namespace) -> None:
    client = AsyncOrchClient(address)
    try:
        async for _ in client.generate(token_ids=[5] * args.input_len, max_tokens=4,
                                       ignore_eos=True, timeout_s=300):
            pass
    finally:
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--levels", nargs="+", default=list(LEVELS), choices=list(LEVELS))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=300)
    parser.add_argument("--repo", type=Path, default=REPO,
                        help="checkout whose `orch up` runs (default: this one)")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"| level | in flight | CPU ms / output token | output tokens | s | by process "
          f"(ms / token) | load average |  ({args.repo})")
    print("|---|---|---|---|---|---|---|")
    for level, ms, tokens, seconds, by_name in run_levels(args):
        top = ", ".join(f"{n} {v:.3f}" for n, v in sorted(by_name.items(),
                                                          key=lambda kv: -kv[1]) if v >= 5e-4)
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        print(f"| {level} | {LEVELS[level]} | {ms:.3f} | {tokens} | {seconds:.1f} | {top} | "
              f"{load} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

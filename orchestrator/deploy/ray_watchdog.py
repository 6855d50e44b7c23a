"""A watchdog process that stops the embedded Ray's processes when `orch up` dies without its
teardown (kill -9, an OOM kill).

Ray's own gcs_server and raylet die with their parent, but the dashboard and runtime-env
agents (children of the raylet) only notice minutes later, and a SIGKILLed parent runs no
cleanup. ``PR_SET_PDEATHSIG`` cannot help: Ray spawns those agents itself, so no preexec of
ours runs in them. The watchdog is a small process of its own session (a terminal's Ctrl-C
does not reach it) whose stdin is a pipe from `orch up`: every ``POLL_S`` it notes the Ray
processes under `orch up` (pid and start time, so a reused pid is never hit); when the pipe
ends (`orch up` exited, cleanly or not) it sends SIGTERM to those still alive, then SIGKILL
after ``GRACE_S``. Only processes that appeared after the watchdog started and whose command
line names Ray are noted: an in-process caller's other children are never touched.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.5
GRACE_S = 2.0
Process = tuple[int, int]  # (pid, start time in clock ticks since boot)


def start_watchdog() -> subprocess.Popen:
    """Start the watchdog of this process; keep the handle (its stdin is the life line) and
    call :func:`stop_watchdog` after the teardown."""
    return subprocess.Popen([sys.executable, "-m", "orchestrator.deploy.ray_watchdog",
                             str(os.getpid())], stdin=subprocess.PIPE, start_new_session=True,
                            close_fds=True)


def stop_watchdog(watchdog: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """End the life line: the watchdog stops what is left of Ray and exits (bounded wait)."""
    if watchdog.stdin is not None:
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        watchdog.kill()


def _processes(known: dict[int, tuple[int, int, str]] | None = None
               ) -> dict[int, tuple[int, int, str]]:
    """Every process: pid -> (parent pid, start time, command line). Entries of ``known``
    (an earlier answer) are reused for pids still there: only new pids' files are read.

    NOTE: a poll reads two files of each new process and lists /proc, no more: reading every
    process's files each poll cost ~2 % of a core on a quiet host (counted against the
    router, benchmarks/router_cpu_bench.py). A pid reused between two polls keeps its old
    entry; :func:`_alive` checks start times before anything is signalled.
    """
    known = known or {}
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in known:
            out[pid] = known[pid]
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            argv = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:  # ended meanwhile
            continue
        out[pid] = (int(stat[1]), int(stat[19]), argv.decode(errors="replace"))
    return out


def _ray_descendants(root: int, existing: set[Process],
                     procs: dict[int, tuple[int, int, str]]) -> set[Process]:
    """Ray processes under ``root`` among ``procs`` (:func:`_processes`) that are not in
    ``existing`` (nor this watchdog)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, frontier = set(), [root]
    while frontier:
        for pid in children.get(frontier.pop(), []):
            frontier.append(pid)
            _, start, argv = procs[pid]
            if pid != os.getpid() and (pid, start) not in existing and "ray" in argv.lower():
                found.add((pid, start))
    return found


def _alive(noted: set[Process]) -> set[Process]:
    procs = _processes()
    return {(pid, start) for pid, start in noted if pid in procs and procs[pid][1] == start}


def _stop(noted: set[Process]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid, _ in _alive(noted):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + GRACE_S
        while _alive(noted) and time.monotonic() < deadline:
            time.sleep(0.05)


def main(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    procs = _processes()
    existing = {(pid, start) for pid, (_, start, _) in procs.items()}
    noted: set[Process] = set()
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the life line ended: orch up exited
        procs = _processes(procs)
        noted |= _ray_descendants(parent, existing, procs)
    _stop(noted)


if __name__ == "__main__":
    main(int(sys.argv[1]))

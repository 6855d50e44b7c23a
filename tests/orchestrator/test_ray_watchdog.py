"""The embedded Ray's watchdog finds Ray processes under `orch up` reading only new pids' files."""

from __future__ import annotations

import os
import subprocess
import sys

from orchestrator.deploy import ray_watchdog


def test_a_new_ray_child_is_found_and_known_pids_are_not_read_again(monkeypatch):
    procs = ray_watchdog._processes()
    existing = {(pid, start) for pid, (_, start, _) in procs.items()}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "raylet"])
    try:
        reads: list[str] = []
        real = ray_watchdog.Path

        def counting(path: str):
            reads.append(path)
            return real(path)
        monkeypatch.setattr(ray_watchdog, "Path", counting)
        procs = ray_watchdog._processes(procs)
        found = ray_watchdog._ray_descendants(os.getpid(), existing, procs)
        assert child.pid in {pid for pid, _ in found}
        assert f"/proc/{os.getpid()}/stat" not in reads  # NOTE: known: not read again
        assert f"/proc/{child.pid}/cmdline" in reads
    finally:
        child.kill()
        child.wait()

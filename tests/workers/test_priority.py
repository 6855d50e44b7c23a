"""rank/priority.py: with ORCH_RANK_NICE=0 a rank started at Ray's nice 15 sets every thread
back to nice 0 (issue 36); without the right to, it keeps the value and says so; unset, it
changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import json, os, threading
os.nice(15)  # as Ray starts its workers
ready, done = threading.Event(), threading.Event()
t = threading.Thread(target=lambda: (ready.set(), done.wait(10)))
t.start(); ready.wait(10)
from rank.priority import raise_priority
ok = raise_priority()
later = []
t2 = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0)))
t2.start(); t2.join(10)
print(json.dumps([ok, os.getpriority(os.PRIO_PROCESS, 0),
                  os.getpriority(os.PRIO_PROCESS, t.native_id), later[0]]))
done.set(); t.join(10)
"""


def run_child(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True,
                          text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), **env))


def test_every_thread_goes_back_to_nice_0_when_asked_and_allowed():
    out = run_child(ORCH_RANK_NICE="0")
    assert out.returncode == 0, out.stderr
    ok, main, other, later = json.loads(out.stdout)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    if os.geteuid() == 0:  # NOTE: CAP_SYS_NICE: lowering is allowed
        assert (ok, main, other, later) == (True, 0, 0, 0)
    else:
        assert (ok, main, other) == (False, base + 15, base + 15)
        assert "could not set nice 0" in out.stderr


def test_unset_keeps_rays_nice_value():
    out = run_child(ORCH_RANK_NICE="")
    assert out.returncode == 0, out.stderr
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert json.loads(out.stdout) == [True, base + 15, base + 15, base + 15]

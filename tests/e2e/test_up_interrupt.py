"""SIGINT while `orch up` (real ranks, the tiny model, embedded Ray) is still starting: at each
stage (inside ray.init, while the rank processes start, while they load the model) it exits
promptly with 130 and one line, prints no traceback, and leaves no process behind (ranks, Ray's
own processes). (kill -9 of a serving `orch up`: test_embedded_ray.py, on its deployment.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.harness import REPO, alive, descendants
from tests.ports import free_port

# (the line that starts the stage, a process that exists once the stage is under way, whether
# orch up starts with SIGINT ignored, as a shell starts a background job `orch up ... &`)
STAGES = [("orch up: starting an embedded Ray", "gcs_server", False),  # inside ray.init
          ("orch up: starting 3 rank processes", "ray::", False),
          ("orch up: loading the model on every rank", "ray::", True)]


def _wait_for_line(log, proc: subprocess.Popen, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert proc.poll() is None, f"orch up exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{log.read_text()}"
        time.sleep(0.05)


def _descendants(root: int, title: str, timeout_s: float) -> set[int]:
    """Every process under ``root`` once one of them has ``title`` in its name."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = descendants(root)
        if any(title in name for name in found.values()):
            return set(found)
        assert time.monotonic() < deadline, f"no {title!r} process in {timeout_s} s: {found}"
        time.sleep(0.05)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("stage, process, ignored", STAGES)
def test_sigint_during_start_up_exits_cleanly(stage, process, ignored, tmp_path):
    log = tmp_path / "up.log"
    env = dict(os.environ, ORCH_CACHE_DIR=str(tmp_path), PYTHONUNBUFFERED="1", RAY_ADDRESS="")
    cmd = [sys.executable, "-m", "orchestrator.cli", "up", str(REPO / "configs" / "hetero_tp_1p1d.yaml"),
           "--port", str(free_port()), "--metrics-port", str(free_port())]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=_ignore_sigint if ignored else None)
    try:
        _wait_for_line(log, proc, stage, timeout_s=240)
        started = _descendants(proc.pid, process, timeout_s=60)
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        assert proc.wait(timeout=60) == 130, log.read_text()
        took = time.monotonic() - sent
        deadline = time.monotonic() + 30
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    output = log.read_text()
    assert alive(started) == set(), f"left running: {alive(started)}\n{output}"
    assert "Traceback" not in output and "AttributeError" not in output, output
    assert output.rstrip().endswith(
        "orch up: interrupted (Ctrl-C or SIGTERM); stopped what had started"), output
    assert took < 30, f"took {took:.1f} s to stop:\n{output}"

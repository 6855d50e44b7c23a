"""SIGINT ends `orch up` within a bound even when the leaders never finish draining or
shutting down (a rank stuck in a failing transfer): they are killed after TEARDOWN_S each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from orchestrator.client import OrchClient
from orchestrator.up import TEARDOWN_S
from tests.orchestrator.test_up import ROOT, _free_port, _write_setup

EXIT_WITHIN_S = 2 * TEARDOWN_S + 15.0  # drain + shutdown bounds, then kills and stopping Ray


def test_sigint_exits_within_a_bound_when_leaders_hang(tmp_path):
    port = _free_port()
    cfg = _write_setup(tmp_path, port)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    log = tmp_path / "up.log"
    proc = subprocess.Popen([sys.executable, "-m", "tests.orchestrator.stuck_up_main", str(cfg)],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        with OrchClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout_s=150)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert time.monotonic() - start < EXIT_WITHIN_S, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

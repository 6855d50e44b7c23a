"""SIGINT ends `orch up` within a bound even when the leaders never finish draining or
shutting down (a rank stuck in a failing transfer): they are killed after TEARDOWN_S each, and
nothing of orch's is left in the Ray cluster it joined (the session Ray: its teardown must
remove what it placed, since no Ray shutdown cleans up after it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from orchestrator.api.client import OrchClient
from orchestrator.up import TEARDOWN_S
from tests.e2e.test_rank_death import live_orch_groups
from tests.orchestrator.test_up import ROOT, _free_port, _write_setup

EXIT_WITHIN_S = 2 * TEARDOWN_S + 15.0  # drain + shutdown bounds, then kills and disconnecting


def test_sigint_exits_within_a_bound_when_leaders_hang(tmp_path, ray_session):
    port = _free_port()
    cfg = _write_setup(tmp_path, port, ray_session.get_runtime_context().gcs_address)
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
        assert not live_orch_groups(ray_session), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

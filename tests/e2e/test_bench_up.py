"""`orch bench --up CONFIG`: brings the config up on free ports, replays against it, stops it."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

from tests.e2e.harness import REPO


def test_bench_up_serves_replays_and_stops(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "bench", "--up",
         str(REPO / "configs" / "colocated.yaml"), "--up-out", str(out), "--workload",
         "synthetic", "--num-requests", "3", "--input-len", "16", "--output-len", "4",
         "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((out / "colocated.json").read_text())
    assert report["counts"]["completed"] == 3
    assert [r["output_tokens"] for r in report["requests"]] == [4, 4, 4]
    log = (out / "colocated.up.log").read_text()
    # NOTE: SIGINT drained and stopped it: nothing is left listening on the port it used.
    port = int(re.search(r"orch serving .* on 127\.0\.0\.1:(\d+)", log).group(1))
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, log[-2000:]

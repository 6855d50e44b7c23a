"""scripts/setup.sh shows progress (issue 25, item 8: it was silent for 75 s): one line per
step, a line every 5 s while pip works, pip's log tail when a step fails. Run against a stub
.venv whose pip installs nothing (no network), its torch step taking 6 s where a heartbeat is
checked."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUB_PYTHON = """#!/usr/bin/env bash
echo "Collecting stub-package-$$"
case "$*" in *torch==*) sleep "${STUB_SLEEP:-0}" ;; esac
exit ${STUB_EXIT:-0}
"""


def _run(tmp_path: Path, exit_code: int, torch_s: int = 0) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(STUB_PYTHON)
    python.chmod(0o755)
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                      "STUB_EXIT": str(exit_code),
                                                      "STUB_SLEEP": str(torch_s)})


def test_setup_prints_each_step_and_a_heartbeat_while_pip_works(tmp_path):
    done = _run(tmp_path, 0, torch_s=6)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "setup: [1/3] .venv exists: updating it"
    assert lines[1].startswith("setup: [2/3] installing torch==2.13.0")
    assert re.fullmatch(r"setup:   \.\.\. [5-9] s \(Collecting stub-package-\d+\)", lines[2]), lines
    assert any(line.startswith("setup: [3/3] installing orch") for line in lines)
    assert lines[-1].startswith("setup: ready in ")


def test_a_failed_step_shows_the_end_of_pips_log(tmp_path):
    done = _run(tmp_path, 1)
    assert done.returncode == 1
    assert "setup: failed: [2/3] installing torch==2.13.0" in done.stderr
    assert "Collecting stub-package-" in done.stderr

"""The committed stubs in orchestrator/api/rpc match proto/orch.proto (regenerate with
`python -m orchestrator.api.rpc.generate`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_has_not_drifted():
    result = subprocess.run([sys.executable, "-m", "orchestrator.api.rpc.generate", "--check"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_drift_check_fails_when_the_generated_code_changes(tmp_path):
    import shutil

    copy = tmp_path / "repo"
    for name in ("orchestrator", "proto"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "orchestrator" / "api" / "rpc" / "orch_pb2.pyi"
    target.write_text(target.read_text() + "\n# edited by hand\n")
    result = subprocess.run([sys.executable, "-m", "orchestrator.api.rpc.generate", "--check"],
                            cwd=copy, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1
    assert "orch_pb2.pyi" in result.stderr

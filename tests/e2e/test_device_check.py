"""scripts/device_check.py can pass and can fail: its CPU dry run (the same six checks, cpu
standing in for the device, tiny sizes; the orch up check left out) passes and writes its
figures, and fed a failing figure (``--figures``) it exits non-zero naming the rule.

NOTE: the dry run goes through the script as a user runs it (a subprocess); the ``--figures``
cases call its ``main`` in this process (one subprocess each, importing torch, cost ~2.5 s of
CI apiece for the same argument parsing and judging).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.e2e.harness import REPO

SCRIPT = REPO / "scripts" / "device_check.py"
CHECKS = ("engine_parity", "mla_roofline", "graph_decode", "killed_peer", "quant_parity")


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def device_check():
    """scripts/device_check.py imported as a module (its ``main(argv)`` is the CLI)."""
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved  # NOTE: the script puts scripts/ first on the path for itself
    return module


def _judge(device_check, capsys, *args: str) -> tuple[int, str]:
    """``device_check.py --figures ...`` in this process: (exit status, stdout)."""
    capsys.readouterr()
    code = device_check.main(["--figures", *args])
    return code, capsys.readouterr().out


def test_dry_run_passes_every_check_and_writes_its_figures(tmp_path):
    done = _run("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads((tmp_path / "device_check.json").read_text())
    figures = doc["figures"]
    assert doc["failed"] == {}
    for name in CHECKS:
        assert f"[PASS] {name}" in done.stdout
        assert "error" not in figures[name], figures[name]
    assert figures["engine_parity"]["tokens_equal"] is True
    assert figures["mla_roofline"]["fraction_of_roofline"] > 0
    assert figures["graph_decode"]["captured"] == [1]
    assert figures["killed_peer"]["peer_survived"] is True
    assert figures["killed_peer"]["pair_error"].startswith("error ")
    assert set(figures["quant_parity"]["schemes"]) == {"fp8-block", "w8a8"}


def _passing() -> dict:
    return {
        "engine_parity": {"max_logit_diff": 1e-5, "tokens_equal": True},
        "pd_same_node": {"requests": 6, "tokens_equal": True},
        "mla_roofline": {"fraction_of_roofline": 0.55},
        "graph_decode": {"max_logit_diff": 1e-6, "tokens_equal": True, "speedup": 2.0},
        "killed_peer": {"victim_ready": True, "peer_survived": True},
        "quant_parity": {"max_logit_diff": 1e-3, "tokens_equal": True},
    }


@pytest.mark.parametrize("check, figure, value, rule", [
    ("mla_roofline", "fraction_of_roofline", 0.12, "fraction_of_roofline = 0.12 (want >= 0.3)"),
    ("graph_decode", "speedup", 0.8, "speedup = 0.8 (want >= 1.0)"),
    ("killed_peer", "peer_survived", False, "peer_survived = False (want == True)"),
    ("engine_parity", "max_logit_diff", 0.5, "max_logit_diff = 0.5 (want <= 0.001)")])
def test_a_failing_figure_fails_the_run(tmp_path, device_check, capsys, check, figure, value,
                                        rule):
    figures = _passing()
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"figures": figures}))
    assert _judge(device_check, capsys, str(path))[0] == 0
    figures[check][figure] = value
    path.write_text(json.dumps({"figures": figures}))
    code, stdout = _judge(device_check, capsys, str(path), "--out", str(tmp_path / "out"))
    assert code == 1, stdout
    assert f"[FAIL] {check}: {rule}" in stdout
    failed = json.loads((tmp_path / "out" / "device_check.json").read_text())["failed"]
    assert failed == {check: [rule]}


def test_a_check_that_raised_fails(tmp_path, device_check, capsys):
    figures = _passing()
    figures["pd_same_node"] = {"error": "RuntimeError: orch up not serving"}
    path = tmp_path / "figures.json"
    path.write_text(json.dumps(figures))
    code, stdout = _judge(device_check, capsys, str(path))
    assert code == 1
    assert "[FAIL] pd_same_node: error: RuntimeError: orch up not serving" in stdout

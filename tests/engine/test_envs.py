"""Environment variables: declared once in engine/envs.py, read nowhere else, all documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import envs

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orchestrator", "prefill_worker", "decode_worker", "kv_transfer", "engine")


def test_no_package_reads_the_environment_outside_envs():
    offenders = [f"{path.relative_to(ROOT)}:{n}"
                 for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
                 if path != ROOT / "engine" / "envs.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.search(r"os\.environ|os\.getenv|os\.putenv", line)]
    assert offenders == [], "declare the variable in engine/envs.py and read it there"


def test_docs_list_every_variable():
    text = (ROOT / "docs" / "config.md").read_text()
    section = text[text.index("## Environment"):]
    assert [v.name for v in envs.ALL] == re.findall(r"^\| `([A-Z_]+)` \|", section, re.M)


def test_values_defaults_and_errors(monkeypatch):
    monkeypatch.delenv("ORCH_TORCH_THREADS", raising=False)
    assert envs.ORCH_TORCH_THREADS.get() == 1
    monkeypatch.setenv("ORCH_TORCH_THREADS", "")
    assert envs.ORCH_TORCH_THREADS.get() == 1
    monkeypatch.setenv("ORCH_TORCH_THREADS", "3")
    assert envs.ORCH_TORCH_THREADS.get() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv("ORCH_TORCH_THREADS", bad)
        with pytest.raises(ValueError, match=f"ORCH_TORCH_THREADS='{bad}' is invalid"):
            envs.ORCH_TORCH_THREADS.get()


def test_set_default_keeps_a_value_already_set(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    envs.GLOO_SOCKET_IFNAME.set_default("lo")
    assert envs.GLOO_SOCKET_IFNAME.get() == "eth7"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    envs.GLOO_SOCKET_IFNAME.set_default("lo")
    assert envs.GLOO_SOCKET_IFNAME.get() == "lo"


def test_set_default_fills_an_empty_value_and_unset_removes(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    envs.GLOO_SOCKET_IFNAME.set_default("lo")
    assert envs.GLOO_SOCKET_IFNAME.get() == "lo"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    envs.RAY_ADDRESS.unset()
    assert envs.RAY_ADDRESS.get() == ""

"""engine.platform decides device and dist backend in one place: ``platform_for`` (settings,
e.g. the orch config's cluster.device and kv_transfer.backend) and ``detect_platform`` (what is
present); no other module reads the device/backend table."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from engine.platform import DIST_BACKENDS, Platform, detect_platform, platform_for
from orchestrator.config.schema import OrchConfig
from tests.import_graph import PACKAGES, find_modules

ROOT = Path(__file__).resolve().parents[2]

DEVICES = ("cpu", "cuda", "npu")
BACKENDS = ("gloo", "nccl", "hccl")


@pytest.mark.parametrize("device", ("auto",) + DEVICES)
@pytest.mark.parametrize("backend", ("auto",) + BACKENDS)
def test_a_set_device_wins_else_the_backends_device_else_detection(device, backend,
                                                                   monkeypatch):
    monkeypatch.setenv("ORCH_DEVICE", "cuda")  # what detection answers (no GPU needed)
    want = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
    if device != "auto" and backend != "auto" and want[device] != backend:
        with pytest.raises(ValueError, match=f"backend '{backend}' does not work with device "
                                             f"'{device}': use backend '{want[device]}'"):
            platform_for(device, backend)
        return
    got = platform_for(device, backend)
    if device != "auto":
        assert got == Platform(device, want[device])
    elif backend != "auto":
        assert got == Platform({b: d for d, b in want.items()}[backend], backend)
    else:
        assert got == detect_platform() == Platform("cuda", "nccl")


def test_a_set_npu_is_a_table_lookup_without_torch_npu():
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is installed and imported here")
    assert platform_for("npu") == platform_for(backend="hccl") == Platform("npu", "hccl")
    assert "torch_npu" not in sys.modules
    with pytest.raises(RuntimeError, match="torch_npu"):
        detect_platform("npu")  # a rank that must run on it imports it


def test_errors_name_the_callers_keys():
    keys = ("cluster.device", "kv_transfer.backend")
    with pytest.raises(ValueError, match="kv_transfer.backend 'gloo' does not work with "
                                         "cluster.device 'npu': use backend 'hccl'"):
        platform_for("npu", "gloo", keys=keys)
    with pytest.raises(ValueError, match="cluster.device 'tpu' is not one of"):
        platform_for("tpu", keys=keys)
    with pytest.raises(ValueError, match="kv_transfer.backend 'mpi' is not one of"):
        platform_for(backend="mpi", keys=keys)


@pytest.mark.parametrize("device", ("auto",) + DEVICES)
@pytest.mark.parametrize("backend", ("auto",) + BACKENDS)
def test_the_config_and_its_ranks_use_the_one_decision(device, backend, monkeypatch):
    monkeypatch.setenv("ORCH_DEVICE", "cpu")
    if device != "auto" and backend != "auto" and DIST_BACKENDS[device] != backend:
        return  # refused when the config loads (test_config)
    cfg = OrchConfig.model_validate({"cluster": {"device": device},
                                     "kv_transfer": {"backend": backend}})
    decided = platform_for(device, backend)
    assert cfg.platform() == decided
    assert {(i.parallel.device, i.parallel.dist_backend) for i in cfg.instances()} == \
        {(decided.device_type, decided.dist_backend)}


def test_no_other_module_reads_the_device_backend_table():
    """Outside engine/platform.py, modules ask it (Platform, platform_for, detect_platform)
    and never map devices to backends themselves from its tables."""
    readers = []
    for module, path in find_modules(ROOT, PACKAGES).items():
        if module == "engine.platform":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "engine.platform":
                readers += [f"{module} imports {a.name}" for a in node.names
                            if a.name not in ("Platform", "platform_for", "detect_platform",
                                              "AUTO")]
    assert readers == [], readers

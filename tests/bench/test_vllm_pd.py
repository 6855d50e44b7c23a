"""benchmarks/vllm_pd.py without vLLM or NIXL: both servers get NixlConnector with a CPU KV
buffer; pausing stops and resumes a server's whole process group; the ``sitecustomize`` of
``--vllm-pd-progress-thread off`` turns the progress thread's default off and nothing else."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from benchmarks import vllm_pd, vllm_server


def test_both_servers_run_nixl_with_a_cpu_kv_buffer():
    cfg = json.loads(vllm_pd.kv_transfer_config())
    assert cfg == {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                   "kv_buffer_device": "cpu"}


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, want: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (got := _state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_pause_stops_and_resume_continues_each_servers_process_group():
    # NOTE: a parent (the "server") and its child (an engine process) in one new session
    # NOTE: popen_session: SIGINT stops them even when this test runs in the background
    # (`pytest &` ignores SIGINT, and children inherit that: stop() then waited 60 s)
    procs = [vllm_server.popen_session([sys.executable, "-c",
                                        "import subprocess, sys, time; "
                                        "c = subprocess.Popen([sys.executable, '-c', "
                                        "'import time; time.sleep(60)']); "
                                        "print(c.pid, flush=True); time.sleep(60)"],
                                       stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        children = [int(p.stdout.readline()) for p in procs]
        side = vllm_pd.PDServers("http://127.0.0.1:1/v1", tuple(procs))
        side.pause()
        for pid in [p.pid for p in procs] + children:
            assert _wait_state(pid, "T") == "T"
        side.resume()
        for pid in [p.pid for p in procs] + children:
            assert _wait_state(pid, "S") == "S"
    finally:
        started = time.monotonic()
        for p in procs:
            vllm_pd.stop(p)
    assert all(p.poll() is not None for p in procs)
    assert time.monotonic() - started < vllm_server.STOP_TIMEOUT_S  # NOTE: SIGINT, not SIGKILL


def test_the_sitecustomize_turns_only_the_progress_thread_default_off(monkeypatch):
    class FakeConfig:
        def __init__(self, enable_prog_thread=True, enable_listen_thread=False, num_threads=0):
            self.args = (enable_prog_thread, enable_listen_thread, num_threads)

    api = types.ModuleType("nixl_cu12._api")
    api.nixl_agent_config = FakeConfig
    pkg = types.ModuleType("nixl_cu12")
    pkg._api = api
    monkeypatch.setitem(sys.modules, "nixl_cu12", pkg)
    monkeypatch.setitem(sys.modules, "nixl_cu12._api", api)
    monkeypatch.setenv("UCX_RCACHE_MAX_UNRELEASED", "7")
    exec(compile(vllm_pd._SITECUSTOMIZE, "sitecustomize.py", "exec"), {})
    assert FakeConfig().args == (False, False, 0)
    assert os.environ["UCX_RCACHE_MAX_UNRELEASED"] == "7"  # NOTE: a set value is kept
    assert FakeConfig(num_threads=4).args == (False, False, 4)
    assert FakeConfig(enable_prog_thread=True).args == (True, False, 0)


def test_vllm_runs_with_its_prefix_cache_off_and_the_extra_args(tmp_path):
    # NOTE: a fake venv whose python records its arguments (no vLLM here)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("")
    argv = tmp_path / "argv"
    python = venv / "bin" / "python"
    python.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {argv}\n")
    python.chmod(0o755)
    proc, base, _ = vllm_pd.launch_vllm(venv, tmp_path / "ckpt", 8123, tmp_path / "log",
                                        max_num_seqs=8, max_model_len=320, env={},
                                        extra_args=["--kv-transfer-config", "{}"])
    assert proc.wait(timeout=30) == 0 and base == "http://127.0.0.1:8123/v1"
    args = argv.read_text().split("\n")
    assert "--no-enable-prefix-caching" in args
    assert args[args.index("--kv-transfer-config") + 1] == "{}"
    assert args[args.index("--max-num-seqs") + 1] == "8"


@pytest.mark.parametrize("broken", [False, True])
def test_torch_addons_are_removed_only_when_torchvision_is_there_and_broken(
        tmp_path, monkeypatch, broken):
    # NOTE: the fake venv's python runs this interpreter for the probe and records pip calls
    venv, pip_calls = tmp_path / "venv", tmp_path / "pip_calls"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ]; then echo "$@" >> {pip_calls}; exit 0; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    site = tmp_path / "site"
    if broken:
        (site / "torchvision").mkdir(parents=True)
        (site / "torchvision" / "__init__.py").write_text("raise RuntimeError('nms')\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    with (tmp_path / "log").open("w") as log:
        vllm_server._drop_broken_addons(venv, log)
    calls = pip_calls.read_text() if pip_calls.exists() else ""
    assert ("uninstall -y torchvision" in calls) is broken

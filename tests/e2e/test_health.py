"""Health of real ranks under `orch up` (1 prefill, 2 decode instances of tp 1, session Ray).

(a) kill -9 of one decode rank while both decode instances stream: `orch status` shows that
instance unhealthy within a few seconds, new requests all go to the other one and succeed,
the health gauge drops. (b) SIGSTOP of every live decode rank: unhealthy within probe_timeout_s +
probe_interval_s, `orch status` still answers within 5 s (exit 3), gRPC health NOT_SERVING,
new requests are refused at once with UNAVAILABLE; SIGCONT afterwards.

NOTE: assumes no automatic restart brings the instances back during the test (recovery off).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.harness import REPO, OrchProcess

PROBE_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 2.0
MAX_TOKENS = 200
STATUS_SLACK_S = 2.0  # an `orch status` round trip on a loaded 2-core machine


@pytest.fixture(scope="module")
def orch(ray_session, tmp_path_factory):
    overrides = {"cluster.address": ray_session.get_runtime_context().gcs_address,
                 "cluster.bind_host": "127.0.0.1", "decode.dp": 2, "decode.tp": 1,
                 "router.request_timeout_s": 60,
                 "health.probe_interval_s": PROBE_INTERVAL_S,
                 "health.probe_timeout_s": PROBE_TIMEOUT_S,
                 "health.max_restarts": 0}  # NOTE: recovery off (see the docstring)
    with OrchProcess(REPO / "configs" / "1p1d.yaml", tmp_path_factory.mktemp("health"),
                     overrides) as orch:
        yield orch


def decode_pids(orch: OrchProcess) -> list[int]:
    """The live decode rank processes (tp 1: each is its instance's leader)."""
    return sorted(pid for name in ("decode-0", "decode-1") for pid in orch.rank_pids(name)
                  if _alive(pid))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def orch_status(orch: OrchProcess) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status", "--address",
                           orch.address, "--timeout", "10"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    return done, time.monotonic() - start


def unhealthy(orch: OrchProcess) -> list[str]:
    return [i.name for i in orch.status().instances if i.health != "healthy"]


def wait_unhealthy(orch: OrchProcess, timeout_s: float) -> list[str]:
    """The unhealthy instances, once there is one (fails after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not (names := unhealthy(orch)):
        assert time.monotonic() < deadline, orch.status()
        time.sleep(0.1)
    return names


def grpc_health(orch: OrchProcess) -> int:
    with grpc.insecure_channel(orch.address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_killed_decode_rank_is_skipped(orch):
    results, started = [None, None], [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        results[i] = orch.generate(token_ids=[5 + i] * 20, started=started[i],
                                   max_tokens=MAX_TOKENS, ignore_eos=True)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    pids = decode_pids(orch)
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    (dead,) = wait_unhealthy(orch, timeout_s=PROBE_INTERVAL_S + 3.0)
    for t in threads:
        t.join(90)
    done, _ = orch_status(orch)
    assert done.returncode == 3, done
    row = next(line for line in done.stdout.splitlines() if line.startswith(dead))
    assert row.split()[1:4] == ["decode", "1", "unhealthy"] and "is gone" in row, row

    alive = {"decode-0": "decode-1", "decode-1": "decode-0"}[dead]
    gauge = orch.metrics()
    assert gauge[f"orch_instance_healthy{{instance={dead},role=decode}}"] == 0
    assert gauge[f"orch_instance_healthy{{instance={alive},role=decode}}"] == 1
    # the killed instance's stream migrated to the other decode and completed (docs/scaling.md)
    assert all(err is None and len(tokens) == MAX_TOKENS for tokens, _, err in results), results
    assert {r[1][-1].stats.decode_instance for r in results} == {alive}, results
    for n in range(4):
        tokens, responses, err = orch.generate(token_ids=[7, n], max_tokens=4,
                                               ignore_eos=True, timeout_s=60)
        assert err is None and len(tokens) == 4, err
        assert responses[-1].stats.decode_instance == alive
    assert grpc_health(orch) == health_pb2.HealthCheckResponse.SERVING


def test_stopped_decode_ranks_are_unhealthy_and_status_still_answers(orch):
    pids = decode_pids(orch)  # NOTE: one when the test above killed the other
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        while sum(name.startswith("decode-") for name in unhealthy(orch)) < 2:
            took = time.monotonic() - start
            assert took < PROBE_TIMEOUT_S + PROBE_INTERVAL_S + STATUS_SLACK_S, orch.status()
            time.sleep(0.1)
        done, took = orch_status(orch)
        assert took < 5.0 and done.returncode == 3, (took, done)
        assert "did not answer a ping within health.probe_timeout_s=2 s" in done.stdout
        assert grpc_health(orch) == health_pb2.HealthCheckResponse.NOT_SERVING
        start = time.monotonic()
        _, _, err = orch.generate(token_ids=[9], max_tokens=4, timeout_s=30)
        took = time.monotonic() - start
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert "no healthy decode instance" in err.details() and took < 3.0, (took, err)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

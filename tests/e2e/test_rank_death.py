"""`orch up configs/1p1d.yaml` joined to a Ray cluster the tests started (the session Ray).

A decode rank process killed with SIGKILL while 8 requests stream (greedy, then seeded
sampling): `orch status` shows the instance out of service, naming the dead rank (exit code 3);
orch restarts the instance and every request migrates there (prompt + streamed tokens placed
again) and completes equal token for token to an undisturbed run. Then SIGINT: orch exits 0 and
none of its placement groups is left alive in the cluster it joined.
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

from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
from tests.e2e.harness import REPO, OrchProcess

REQUEST_TIMEOUT_S = 120.0  # a migration waits for the restart within it
MAX_TOKENS = 400
MIN_STREAMED = 3  # tokens every stream has before the kill: mid-decode
UNHEALTHY_WITHIN_S = 5.0  # health.probe_interval_s (1 s) + `orch status` start-up
RECOVER_WITHIN_S = 90.0  # a restart: new actors import torch and load the model (loaded CI)


@pytest.fixture(scope="module")
def joined(ray_session, tmp_path_factory):
    overrides = {"cluster.address": ray_session.get_runtime_context().gcs_address,
                 "cluster.bind_host": "127.0.0.1",
                 "router.request_timeout_s": REQUEST_TIMEOUT_S}
    with OrchProcess(REPO / "configs" / "1p1d.yaml", tmp_path_factory.mktemp("joined"),
                     overrides) as orch:
        yield orch


def live_orch_groups(ray) -> dict[str, str]:
    """Placement group id -> name, for every orch group of the cluster not yet removed."""
    return {pg_id: pg["name"] for pg_id, pg in ray.util.placement_group_table().items()
            if pg["name"].startswith("orch-") and pg["state"] != "REMOVED"}


STREAMS = 8
PROMPTS = [f"stream {i}: tell me about the sea" for i in range(STREAMS)]


class Stream(threading.Thread):
    """One streamed request on its own thread: its tokens, the error that ended it, when."""

    def __init__(self, orch: OrchProcess, text: str, sampling: dict) -> None:
        super().__init__(daemon=True)
        self.orch, self.text, self.sampling = orch, text, sampling
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.ended = 0.0

    def run(self) -> None:
        req = orch_pb2.GenerateRequest(text=self.text, sampling=orch_pb2.SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, **self.sampling))
        with grpc.insecure_channel(self.orch.address) as channel:
            try:
                for resp in orch_pb2_grpc.OrchStub(channel).Generate(req, timeout=300):
                    self.tokens.extend(resp.token_ids)
            except grpc.RpcError as err:
                self.error = err
        self.ended = time.monotonic()


def run_streams(orch: OrchProcess, sampling: list[dict], kill: bool) -> list[Stream]:
    """STREAMS requests at once; with ``kill``, decode-0's rank 1 gets SIGKILL once every
    stream has MIN_STREAMED tokens, and `orch status` must show decode-0 out of service
    naming the dead rank while they wait."""
    streams = [Stream(orch, text, s) for text, s in zip(PROMPTS, sampling)]
    for stream in streams:
        stream.start()
    if kill:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        while min(len(s.tokens) for s in streams) < MIN_STREAMED:
            assert time.monotonic() < deadline, [len(s.tokens) for s in streams]
            time.sleep(0.02)
        _, follower = orch.rank_pids("decode-0")  # the tp2 decode instance
        os.kill(follower, signal.SIGKILL)
        assert max(len(s.tokens) for s in streams) < MAX_TOKENS, "killed too late"
        check_shows_unhealthy(orch)
    for stream in streams:
        stream.join(timeout=300)
    return streams


def check_shows_unhealthy(orch: OrchProcess) -> None:
    deadline = time.monotonic() + UNHEALTHY_WITHIN_S
    while True:
        done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status",
                               "--address", orch.address, "--timeout", "30"],
                              capture_output=True, text=True, timeout=90, cwd=REPO)
        if done.returncode != 0 or time.monotonic() > deadline:
            break
    assert done.returncode == 3, done  # some instance is not healthy
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line and not line.startswith(" ")}
    assert rows["decode-0"][1:3] == ["decode", "2"], done.stdout
    assert rows["decode-0"][3] in ("unhealthy", "recovering"), done.stdout
    assert "rank 1 is gone" in done.stdout, done.stdout
    assert rows["prefill-0"][1:4] == ["prefill", "1", "healthy"], done.stdout


def wait_all_healthy(orch: OrchProcess) -> None:
    deadline = time.monotonic() + RECOVER_WITHIN_S
    while any(i.health != "healthy" for i in orch.status().instances):
        assert time.monotonic() < deadline, orch.status()
        time.sleep(0.5)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_killed_decode_rank_migrates_its_streams(joined, seeded):
    """kill -9 of a decode rank with STREAMS streams in flight: every one completes, equal
    token for token to an undisturbed run (no token repeated or lost); the streamed tokens
    wait for decode-0's restart and go on there (the only decode instance)."""
    sampling = [dict(temperature=0.9, seed=100 + i) if seeded else {} for i in range(STREAMS)]
    wait_all_healthy(joined)
    calm = run_streams(joined, sampling, kill=False)
    assert all(s.error is None and len(s.tokens) == MAX_TOKENS for s in calm), \
        [(s.error, len(s.tokens)) for s in calm]
    before = joined.metrics().get("orch_migrations_total", 0.0)
    killed = run_streams(joined, sampling, kill=True)
    assert [s.error for s in killed] == [None] * STREAMS, [s.error for s in killed]
    for c, k in zip(calm, killed):
        assert k.tokens == c.tokens, (c.text, c.tokens, k.tokens)
    assert joined.metrics()["orch_migrations_total"] - before >= STREAMS
    print(f"migration ({'seeded' if seeded else 'greedy'}): {STREAMS} streams, "
          f"longest e2e with the kill and restart "
          f"{max(k.ended for k in killed) - min(c.ended for c in calm):.1f} s")
    wait_all_healthy(joined)


def test_sigint_exits_0_and_removes_the_placement_groups(joined, ray_session):
    # NOTE: Ray itself removes a job's non-detached groups once its driver exits, so this
    # checks what a user of the cluster sees (a hang, a non-zero exit or a detached group
    # fails it); Cluster.teardown's own removal is checked in-process by
    # tests/orchestrator/test_cluster.py.
    groups = live_orch_groups(ray_session)
    assert sorted(groups.values()) == ["orch-decode-0", "orch-prefill-0"]
    assert joined.stop() == 0
    assert set(groups).isdisjoint(live_orch_groups(ray_session))

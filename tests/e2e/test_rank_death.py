"""`orch up configs/1p1d.yaml` joined to a Ray cluster the tests started (the session Ray).

A decode rank process killed with SIGKILL while a request streams: the request ends with an
explicit gRPC error (UNAVAILABLE or INTERNAL) within a bound and `orch status` shows the
instance out of service, naming the dead rank (exit code 3); orch restarts the instance, which
then serves again with the same greedy output. Then SIGINT: orch exits 0 and none of its
placement groups is left alive in the cluster it joined.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
from tests.e2e.harness import REPO, OrchProcess

REQUEST_TIMEOUT_S = 60.0
ERROR_WITHIN_S = 30.0  # well under REQUEST_TIMEOUT_S: the failure is seen, not timed out
MAX_TOKENS = 400
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


def test_killed_decode_rank_fails_its_request_and_shows_unhealthy(joined):
    before, _, err = joined.generate("hello there", max_tokens=8)
    assert err is None, err
    _, follower = joined.rank_pids("decode-0")  # the tp2 decode instance
    with grpc.insecure_channel(joined.address) as channel:
        call = orch_pb2_grpc.OrchStub(channel).Generate(orch_pb2.GenerateRequest(
            text="hi", sampling=orch_pb2.SamplingParams(max_tokens=MAX_TOKENS,
                                                         ignore_eos=True)))
        got = []
        for resp in call:
            got.extend(resp.token_ids)
            if len(got) >= 3:
                break
        os.kill(follower, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            for resp in call:
                got.extend(resp.token_ids)
        took = time.monotonic() - killed_at
    assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), \
        err.value
    assert "decode-0" in err.value.details()
    assert took < ERROR_WITHIN_S and len(got) < MAX_TOKENS, (took, len(got))

    deadline = time.monotonic() + UNHEALTHY_WITHIN_S
    while True:
        done = subprocess.run([sys.executable, "-m", "orchestrator.cli", "status",
                               "--address", joined.address, "--timeout", "30"],
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

    deadline = time.monotonic() + RECOVER_WITHIN_S
    while any(i.health != "healthy" for i in joined.status().instances):
        assert time.monotonic() < deadline, joined.status()
        time.sleep(0.5)
    after, _, err = joined.generate("hello there", max_tokens=8)
    assert err is None and after == before, (err, before, after)


def test_sigint_exits_0_and_removes_the_placement_groups(joined, ray_session):
    # NOTE: Ray itself removes a job's non-detached groups once its driver exits, so this
    # checks what a user of the cluster sees (a hang, a non-zero exit or a detached group
    # fails it); Cluster.teardown's own removal is checked in-process by
    # tests/orchestrator/test_cluster.py.
    groups = live_orch_groups(ray_session)
    assert sorted(groups.values()) == ["orch-decode-0", "orch-prefill-0"]
    assert joined.stop() == 0
    assert set(groups).isdisjoint(live_orch_groups(ray_session))

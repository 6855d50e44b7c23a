"""The embedded Ray (the default `cluster.address: ""`), on one `orch up`:

- it is private: with another Ray cluster running on the host and RAY_ADDRESS pointing at it
  (here: the test session's Ray), `orch up` starts its own local cluster, serves, and leaves
  nothing in the other one;
- last, `orch up` killed outright (kill -9: no teardown runs): the embedded Ray's processes,
  its dashboard and runtime-env agents and the ranks included, are gone within seconds (the
  watchdog, orchestrator/deploy/ray_watchdog.py), not minutes.

NOTE: one bring-up for both (an embedded one costs ~30 s of CI); SIGINT during start-up is
test_up_interrupt.py's.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.harness import REPO, OrchProcess, alive, cmdline, descendants, wait_idle

MAX_TOKENS = 4


def _orch_groups(ray) -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith("orch-") and pg["state"] != "REMOVED"]


@pytest.fixture(scope="module")
def embedded(ray_session, tmp_path_factory):
    """`orch up configs/hetero_tp_1p1d.yaml` started with RAY_ADDRESS set to the session Ray's."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
        with OrchProcess(REPO / "configs" / "hetero_tp_1p1d.yaml",
                         tmp_path_factory.mktemp("embedded")) as orch:
            yield orch


def test_embedded_ray_ignores_a_running_cluster_and_ray_address(embedded, ray_session):
    tokens, _, err = embedded.generate("Hello there", max_tokens=MAX_TOKENS)
    assert err is None and len(tokens) == MAX_TOKENS, err
    assert not _orch_groups(ray_session), "orch placed its ranks in the other cluster"
    wait_idle(embedded)


def test_kill_9_of_orch_up_leaves_no_ray_process_behind(embedded):
    """Last: it kills the module's `orch up`."""
    found = descendants(embedded.proc.pid)
    started = set(found)
    try:
        assert any("raylet" in title for title in found.values()), found
        embedded.proc.kill()
        embedded.proc.wait(10)
        deadline = time.monotonic() + 20
        while alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: cmdline(pid) for pid in alive(started)}
        assert left == {}, f"left running after kill -9: {left}\n{embedded.log.read_text()}"
    finally:
        for pid in alive(started):
            os.kill(pid, signal.SIGKILL)

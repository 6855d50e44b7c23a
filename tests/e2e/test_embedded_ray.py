"""The embedded Ray is private: with another Ray cluster running on the host and RAY_ADDRESS
pointing at it (here: the test session's Ray), `orch up` on the default `cluster.address: ""`
starts its own local cluster, serves, and leaves nothing in the other one."""

from __future__ import annotations

from tests.e2e.harness import REPO, OrchProcess, wait_idle

MAX_TOKENS = 4


def _orch_groups(ray) -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["name"].startswith("orch-") and pg["state"] != "REMOVED"]


def test_embedded_ray_ignores_a_running_cluster_and_ray_address(ray_session, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", ray_session.get_runtime_context().gcs_address)
    with OrchProcess(REPO / "configs" / "hetero_tp_1p1d.yaml", tmp_path) as orch:
        tokens, _, err = orch.generate("Hello there", max_tokens=MAX_TOKENS)
        assert err is None and len(tokens) == MAX_TOKENS, err
        assert not _orch_groups(ray_session), "orch placed its ranks in the other cluster"
        wait_idle(orch)

"""`orch up configs/ep_1p1d.yaml` end to end (issue 11): prefill dp1 x tp2 and decode dp2 x tp1,
both expert-parallel, on the tiny model (8 routed experts, 4 per rank); 16 concurrent ShareGPT
prompts, greedy, equal to the colocated baseline token for token; both decode DP ranks served
requests (KV reached each); afterwards every block is free and nothing is in flight. Then the
decode role resized live as a whole (issue 29): EP 2 -> 4, the same outputs."""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle
from tests.e2e.test_rank_death import _alive, live_orch_groups, orch_scale


def _decode_instances_fed(orch: OrchProcess, names=("decode-0", "decode-1"),
                          timeout_s: float = 30) -> set[str]:
    """Decode instances KV was sent to (per-pair transfer metrics; the router records them at
    its status polls, so wait for ``names``, bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        fed = {key.split("->")[1].split(":")[0] for key, value in orch.metrics().items()
               if key.startswith("orch_kv_transfer_bytes_total{") and value > 0}
        if fed >= set(names) or time.monotonic() > deadline:
            return fed
        time.sleep(0.5)


@pytest.fixture(scope="module")
def ep_orch(tmp_path_factory, joined_ray):
    with OrchProcess(REPO / "configs" / "ep_1p1d.yaml", tmp_path_factory.mktemp("ep"),
                     joined_ray) as orch:
        yield orch


def test_expert_parallel_pd_equals_colocated(ep_orch, prompts, colocated_outputs):
    orch = ep_orch
    outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
    status = orch.status()
    assert sorted((i.name, i.tp) for i in status.instances) == [
        ("decode-0", 1), ("decode-1", 1), ("prefill-0", 2)]
    assert all(len(o) == MAX_TOKENS for o in outputs)
    for i, (ep, co) in enumerate(zip(outputs, colocated_outputs)):
        assert ep == co, f"request {i}: EP {ep} != colocated {co}"
    assert _decode_instances_fed(orch) >= {"decode-0", "decode-1"}
    wait_idle(orch)


def test_the_ep_decode_role_is_resized_as_a_whole(ep_orch, prompts, colocated_outputs,
                                                  ray_session):
    """`orch scale decode=4` of the EP decode role (dp 2): a new EP group of 4 DP ranks
    beside the old one, routing switched, the old one drained and stopped (its processes and
    placement groups gone); the new group serves the colocated outputs token for token."""
    orch = ep_orch
    olds = {name: orch.rank_pids(name) for name in ("decode-0", "decode-1")}
    done, took = orch_scale(orch, "decode=4")
    assert done.returncode == 0, done
    news = ["decode-2", "decode-3", "decode-4", "decode-5"]
    assert f"added {', '.join(news)}; removed decode-0, decode-1" in done.stdout, done.stdout
    print(f"\norch scale decode=4 (EP group 2 -> 4, 4 new rank processes): {took:.1f} s")
    assert sorted(i.name for i in orch.status().instances) == sorted(["prefill-0", *news])
    outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
    assert outputs == colocated_outputs
    assert _decode_instances_fed(orch, news, timeout_s=5) & set(news)
    assert not {"orch-decode-0", "orch-decode-1"} & set(live_orch_groups(ray_session).values())
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pids in olds.values() for pid in pids):
        assert time.monotonic() < deadline, f"the old group's ranks {olds} still run"
        time.sleep(0.2)
    wait_idle(orch)

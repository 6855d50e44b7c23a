"""Ray bring-up against fake rank classes on one session-wide local Ray."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.deploy.assemble import build_router
from orchestrator.deploy.cluster import bring_up
from orchestrator.deploy.rank_actors import BringUpError
from orchestrator.config.schema import OrchConfig
from orchestrator.router.request import GenerateInput
from engine.sampling_params import SamplingParams
from tests.orchestrator.fake_ranks import ROLES, FakeRank
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import MODEL


def _cfg(**decode) -> OrchConfig:
    return OrchConfig.model_validate({
        "model": {"max_model_len": 256}, "cluster": {"device": "cpu", "cpus_per_rank": 0.1,
                                                    "startup_timeout_s": 60},
        "prefill": {"tp": 1, "num_kv_blocks": 16},
        "decode": {"tp": 2, "num_kv_blocks": 16, **decode},
        "router": {"request_timeout_s": 20}})


def _live_pgs(ray) -> list[str]:
    return [pg["name"] for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED" and pg["name"].startswith("orch-")]


def test_bring_up_sequence_serving_and_teardown(ray_session):
    ray = ray_session
    cluster = bring_up(_cfg(), roles=ROLES, rank_class=FakeRank)
    try:
        assert sorted(cluster.leaders()) == ["decode-0", "prefill-0"]
        assert sorted(_live_pgs(ray)) == ["orch-decode-0", "orch-prefill-0"]
        decode = next(i for i in cluster.instances if i.cfg.name == "decode-0")
        logs = ray.get([r.get_log.remote() for r in decode.ranks], timeout=30)
        port = 29500 + len("decode-0")
        assert logs[0] == [("init", "decode-0", 0), ("open_tp_store",),
                           ("init_rank", "127.0.0.1", port, 2), ("start",)]
        assert logs[1] == [("init", "decode-0", 1), ("init_rank", "127.0.0.1", port, 2)]
        assert [d for _, d in decode.nodes] == ["cpu", "cpu"]
        prompt = (11, 12, 13)

        async def one_request():
            router = build_router(_cfg(), cluster.leaders(), MODEL, None)
            router.start()
            inp = GenerateInput(None, prompt, SamplingParams(max_tokens=5))
            chunks = [c async for c in router.generate(inp)]
            statuses = await asyncio.gather(*(l.status() for l in router.flow.leaders))
            await router.stop(drain_timeout_s=5)
            return chunks, statuses

        chunks, statuses = asyncio.run(one_request())
        assert [t for c in chunks for t in c.token_ids] == expected_tokens(prompt, 5)
        assert chunks[-1].finish_reason == "length"
        assert {s.name: s.tp for s in statuses} == {"prefill-0": 1, "decode-0": 2}
    finally:
        cluster.teardown()
    assert _live_pgs(ray) == []


def test_failed_rank_init_names_the_rank_and_tears_down(ray_session):
    with pytest.raises(BringUpError, match="decode-0 rank 1: init_rank failed.*simulated"):
        bring_up(_cfg(max_num_seqs=13), roles=ROLES, rank_class=FakeRank)
    assert _live_pgs(ray_session) == []


def test_unplaceable_instance_times_out_with_advice(ray_session):
    cfg = OrchConfig.model_validate({
        "model": {"max_model_len": 256}, "decode": {"num_kv_blocks": 16},
        "prefill": {"num_kv_blocks": 16},
        "cluster": {"device": "cpu", "cpus_per_rank": 64, "startup_timeout_s": 1}})
    with pytest.raises(BringUpError, match="prefill-0: placement group .* not ready within 1 s"):
        bring_up(cfg, roles=ROLES, rank_class=FakeRank)
    assert _live_pgs(ray_session) == []


class InitFailsRank(FakeRank):
    def init_rank(self, host: str, port: int, peers: list, ep_store=None) -> None:
        raise RuntimeError("simulated init failure after a restart")


def test_restart_instance_replaces_its_ranks_and_a_failed_restart_cleans_up(ray_session):
    ray = ray_session
    cluster = bring_up(_cfg(), roles=ROLES, rank_class=FakeRank)
    try:
        old = cluster.ranks_of("decode-0")
        (new,) = cluster.restart_instance("decode-0", timeout_s=60)
        assert cluster.ranks_of("decode-0") == new.ranks and not set(new.ranks) & set(old)
        assert cluster.leaders()["decode-0"] == new.ranks[0]
        logs = ray.get([r.get_log.remote() for r in new.ranks], timeout=30)
        port = 29500 + len("decode-0")
        assert logs[0] == [("init", "decode-0", 0), ("open_tp_store",),
                           ("init_rank", "127.0.0.1", port, 2), ("start",)]
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(old[1].get_log.remote(), timeout=30)
        assert sorted(_live_pgs(ray)) == ["orch-decode-0", "orch-prefill-0"]
        cluster.rank_class = InitFailsRank  # NOTE: only decode-0 is restarted below
        with pytest.raises(BringUpError, match="decode-0 rank 0: init_rank failed.*simulated"):
            cluster.restart_instance("decode-0", timeout_s=60)
        assert cluster.ranks_of("decode-0") == [] and "decode-0" not in cluster.leaders()
        assert _live_pgs(ray) == ["orch-prefill-0"]
        with pytest.raises(KeyError, match="no instance 'decode-7'"):
            cluster.restart_instance("decode-7", timeout_s=5)
    finally:
        cluster.teardown()
    cluster.teardown()  # exactly once: a second call finds nothing to do
    assert _live_pgs(ray) == []


def test_an_expert_parallel_role_restarts_all_its_instances_on_one_new_ep_store(ray_session):
    ray = ray_session
    cluster = bring_up(_cfg(dp=2, tp=1, ep=True), roles=ROLES, rank_class=FakeRank)
    try:
        assert cluster.restart_group("decode-1") == ["decode-0", "decode-1"]
        assert cluster.restart_group("prefill-0") == ["prefill-0"]
        news = cluster.restart_instance("decode-1", timeout_s=60)
        assert [n.cfg.name for n in news] == ["decode-0", "decode-1"]
        logs = ray.get([n.leader.get_log.remote() for n in news], timeout=30)
        assert logs[0] == [("init", "decode-0", 0), ("open_tp_store",), ("open_ep_store",),
                           ("init_rank", "127.0.0.1", 29508, 1, "127.0.0.1", 29600), ("start",)]
        assert logs[1][-2:] == [("init_rank", "127.0.0.1", 29508, 1, "127.0.0.1", 29600),
                                ("start",)]
        assert sorted(_live_pgs(ray)) == ["orch-decode-0", "orch-decode-1", "orch-prefill-0"]
    finally:
        cluster.teardown()


def test_an_ep_role_gets_a_whole_new_group_beside_the_old_one_then_the_old_one_goes(ray_session):
    """Cluster.add_group: the new group's DP rank 0 opens its own EP store and every new rank
    joins it; restarts keep the two groups apart; remove_group stops the old one."""
    from orchestrator.deploy.ep_resize import group_configs

    ray = ray_session
    cfg = _cfg(dp=2, tp=1, ep=True)
    cluster = bring_up(cfg, roles=ROLES, rank_class=FakeRank)
    names = ["decode-2", "decode-3", "decode-4", "decode-5"]
    try:
        news = cluster.add_group(group_configs(cfg, "decode", 4, 2), timeout_s=60)
        assert [n.cfg.name for n in news] == names
        logs = ray.get([n.leader.get_log.remote() for n in news], timeout=30)
        assert [("open_ep_store",) in log for log in logs] == [True, False, False, False]
        assert {log[-2][-2:] for log in logs} == {("127.0.0.1", 29600)}  # joined: its store
        assert cluster.restart_group("decode-4") == names
        assert cluster.restart_group("decode-1") == ["decode-0", "decode-1"]
        with pytest.raises(ValueError, match="in use"):
            cluster.add_group(group_configs(cfg, "decode", 2, 4), timeout_s=5)
        cluster.remove_group(["decode-0", "decode-1"])
        assert sorted(cluster.leaders()) == [*names, "prefill-0"]
        assert sorted(_live_pgs(ray)) == [*(f"orch-{n}" for n in names), "orch-prefill-0"]
    finally:
        cluster.teardown()
    assert _live_pgs(ray) == []

"""Live resizing of an expert-parallel role as a whole (orchestrator/deploy/ep_resize.py)
through the Admin service over fake leaders and a fake cluster: decode EP 2 -> 4 under load
(a new group beside the old one, routing switched, the old one drained and stopped, nothing
failed); a request held on the old group past router.drain_timeout_s migrates to the new one;
the refusals (one instance of an EP role, what the cluster cannot place beside the old group,
a new group that does not start) change nothing."""

from __future__ import annotations

import time

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.api.rpc import orch_pb2 as pb
from orchestrator.deploy.ep_resize import group_configs
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_router import _wait_for
from tests.orchestrator.test_router_failover import _all_released
from tests.orchestrator.test_scaling import PROMPT, Load, _scale, scale_while_held

NEW = ["decode-2", "decode-3", "decode-4", "decode-5"]  # the new group of 4 DP ranks


def _ep_harness(**kwargs) -> Harness:
    """decode-0 and decode-1 as the two DP ranks of an expert-parallel decode role."""
    h = Harness(scaling=True, decode_dp=2, **kwargs)
    h.scaler.cfg = h.cfg.model_copy(update={"decode": h.cfg.decode.model_copy(
        update={"ep": True})})
    return h


@pytest.fixture
def ep():
    h = _ep_harness(max_pending=16)
    yield h
    h.close()


def _health(h: Harness) -> dict[str, str]:
    return h.call_in_loop(lambda: {x.name: x.state.value for x in h.monitor.snapshot()})


def test_the_new_group_is_dp_ranks_0_to_n_of_its_own_size():
    h = _ep_harness()
    try:
        insts = group_configs(h.scaler.cfg, "decode", 4, 2)
        with pytest.raises(ValueError, match="decode.ep"):  # 8 routed experts over 3 ranks
            group_configs(h.scaler.cfg, "decode", 3, 2)
        text = _refused(lambda: _scale(h, decode=3))
        assert "not a valid expert-parallel layout" in text and h.cluster.groups == []
    finally:
        h.close()
    assert [i.name for i in insts] == NEW
    assert [(i.parallel.dp_rank, i.parallel.dp, i.parallel.ep_size) for i in insts] == [
        (0, 4, 4), (1, 4, 4), (2, 4, 4), (3, 4, 4)]


def test_decode_ep_2_to_4_under_load_switches_groups_and_fails_nothing(ep):
    h = ep
    load = Load(h)
    load.start()
    try:
        assert _wait_for(lambda: len(load.results) >= 4)
        reply = _scale(h, decode=4)
        settled = time.monotonic()  # NOTE: requests sent after the reply (test_scaling's Load)
        assert _wait_for(lambda: sum(s > settled for *_, s in load.results) >= 6)
    finally:
        load.stop.set()
        load.join(10)
    assert list(reply.added) == NEW
    assert list(reply.removed) == ["decode-0", "decode-1"] and reply.counts["decode"] == 4
    assert h.cluster.groups == [NEW]
    assert h.cluster.removed == ["decode-0", "decode-1"]
    assert [e for _, _, e, _ in load.results if e] == []
    assert all(t == expected_tokens(PROMPT, 6) for t, *_ in load.results)
    assert {d for _, d, _, sent in load.results if sent > settled} <= set(NEW)
    assert _health(h) == {"prefill-0": "healthy", **{name: "healthy" for name in NEW}}
    assert h.call_in_loop(lambda: sorted(h.router.flow.main)) == [
        "decode-2", "decode-3", "decode-4", "decode-5"]
    assert h.fakes["decode-0"].reserved == {} and h.fakes["decode-1"].reserved == {}
    assert _all_released(h)


def test_a_request_held_on_the_old_group_past_the_drain_timeout_migrates():
    h = _ep_harness(drain_timeout_s=0.3)
    try:
        first, rest, reply = scale_while_held(h, decode=4)
        assert list(reply.removed) == ["decode-0", "decode-1"] and reply.moved_requests == 1
        assert [t for c in [first, *rest] for t in c.token_ids] == expected_tokens(PROMPT, 6)
        assert rest[-1].stats.decode_instance in set(NEW)
        assert _all_released(h)
    finally:
        h.close()


def _refused(call) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    return err.value.details()


def test_one_instance_of_an_ep_role_is_never_added_or_removed(ep):
    h = ep
    with OrchClient(h.address) as client:
        text = _refused(lambda: client.admin.RemoveInstance(
            pb.RemoveInstanceRequest(name="decode-1"), timeout=10))
        assert "one DP rank of the expert-parallel decode role" in text
        text = _refused(lambda: client.admin.AddInstance(
            pb.AddInstanceRequest(role="decode"), timeout=10))
        assert "as a whole" in text and "decode=N" in text
    assert h.cluster.added == [] and h.cluster.removed == []


def test_a_group_the_cluster_cannot_place_beside_the_old_one_is_refused_naming_it(ep):
    h = ep
    need = h.call_in_loop(lambda: h.scaler.resources("decode"))["CPU"]
    h.cluster.free = {"CPU": need * 3.5}  # NOTE: 2 more would fit, a group of 4 does not
    text = _refused(lambda: _scale(h, decode=4))
    assert f"CPU: needs {4 * need:g}, {need * 3.5:g} free" in text
    assert "new decode EP group of 4 instance(s) beside the running one of 2" in text
    assert h.cluster.groups == [] and h.cluster.removed == []
    assert _health(h)["decode-0"] == "healthy" and _health(h)["decode-1"] == "healthy"


def test_a_new_group_that_does_not_start_leaves_the_old_one_serving(ep):
    h = ep

    def broken(insts, timeout_s):
        raise RuntimeError("decode-2 rank 0: init_rank failed: test")
    h.cluster.add_group = broken
    text = _refused(lambda: _scale(h, decode=4))
    assert "did not start" in text and "serves on unchanged" in text
    assert _health(h) == {"prefill-0": "healthy", "decode-0": "healthy",
                          "decode-1": "healthy"}
    with OrchClient(h.address) as client:
        chunks = list(client.generate(token_ids=list(PROMPT), max_tokens=3))
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 3)
    assert h.cluster.removed == []


def test_while_two_groups_run_a_restart_takes_only_its_own_group():
    from orchestrator.deploy.cluster import Cluster
    from orchestrator.deploy.rank_actors import InstanceRanks

    h = _ep_harness()
    try:
        cfg = h.scaler.cfg
        olds = [InstanceRanks(i, None) for i in cfg.instances() if i.role == "decode"]
        news = [InstanceRanks(i, None, group="decode@decode-2")
                for i in group_configs(cfg, "decode", 4, 2)]
        cluster = Cluster([*olds, *news], started_ray=False, cfg=cfg)
    finally:
        h.close()
    assert cluster.restart_group("decode-1") == ["decode-0", "decode-1"]
    assert cluster.restart_group("decode-3") == NEW

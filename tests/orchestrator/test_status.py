"""Health as a client sees it: placement skips unhealthy instances, GetStatus is bounded and
shows health, `orch status` rows and exit code, gRPC health per role, health metrics."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator import cli
from orchestrator.api.client import OrchClient
from orchestrator.deploy.health import Health, HealthMonitor
from orchestrator.metrics import RouterMetrics
from rank.messages import InstanceStatusInfo
from tests.orchestrator.harness import Harness


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def fail(h: Harness, name: str, reason: str) -> None:
    h.call_in_loop(lambda: h.monitor.report_failure(name, reason))


def serving(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="orch.v1.Orch"), timeout=5).status


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_no_healthy_instance_of_a_role_is_unavailable_and_not_serving(harness, role):
    assert serving(harness.address) == health_pb2.HealthCheckResponse.SERVING
    fail(harness, f"{role}-0", "rank 1 is gone (ActorDiedError)")
    with OrchClient(harness.address) as client, pytest.raises(grpc.RpcError) as err:
        list(client.generate(token_ids=[3], max_tokens=2, timeout_s=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"no healthy {role} instance ({role}-0 out of service)" in err.value.details()
    # NOTE: nothing was reserved or launched anywhere (no decode blocks held for a request
    # that has no prefill instance).
    assert harness.call_in_loop(lambda: harness.fakes["decode-0"].calls) == []
    assert harness.call_in_loop(lambda: harness.fakes["prefill-0"].calls) == []
    wait_for(lambda: serving(harness.address) == health_pb2.HealthCheckResponse.NOT_SERVING)


def test_status_shows_health_and_skips_asking_an_unhealthy_instance(harness, capsys):
    asked = []
    fake = harness.fakes["decode-0"]
    real_status = fake.status
    fake.status = lambda: asked.append(1) or real_status()
    assert cli.main(["status", "--address", harness.address]) == 0
    fail(harness, "decode-0", "rank 1 did not answer a ping")
    asked.clear()
    capsys.readouterr()

    assert cli.main(["status", "--address", harness.address]) == cli.EXIT_UNHEALTHY
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.splitlines()[2:]
            if not line.startswith(" ")}
    assert rows["decode-0"].split()[:8] == ["decode-0", "decode", "1", "unhealthy",
                                            "-", "-", "-", "-"]
    assert rows["decode-0"].endswith("rank 1 did not answer a ping; automatic recovery is "
                                     "off: restart `orch up`")
    assert rows["prefill-0"].split()[:8] == ["prefill-0", "prefill", "1", "healthy",
                                             "0", "0", "10/10", "0"]
    assert "not healthy: decode-0" in err
    assert asked == []


def test_status_answers_within_its_bound_when_a_leader_hangs(harness):
    async def hang():
        await asyncio.Event().wait()

    harness.fakes["decode-0"].status = hang
    start = time.monotonic()
    with OrchClient(harness.address) as client:
        instances, _, _ = client.status(timeout_s=10)
    took = time.monotonic() - start
    assert took < harness.cfg.health.status_timeout_s + 1.0, took
    decode = instances[1]
    assert (decode.name, decode.tp, decode.health, decode.status) == ("decode-0", 1,
                                                                      "healthy", None)
    assert decode.detail.startswith("no status: decode-0.status did not answer within 2.0 s")
    assert instances[0].status.free_blocks == 10


@dataclass(frozen=True)
class BrokenStatus(InstanceStatusInfo):
    broken: str = ""


def test_a_leader_that_says_it_is_broken_turns_unhealthy(harness):
    harness.fakes["prefill-0"].status = lambda: BrokenStatus(
        name="prefill-0", role="prefill", tp=1, broken="rank 1 is gone")
    with OrchClient(harness.address) as client:
        instances, _, _ = client.status()
    assert instances[0].health == "unhealthy"
    assert instances[0].detail.startswith("its leader says: rank 1 is gone")
    assert not harness.call_in_loop(lambda: harness.monitor.is_healthy("prefill-0"))


def test_health_metrics_follow_the_monitor():
    async def scenario():
        monitor = HealthMonitor({"prefill-0": "prefill", "decode-0": "decode"},
                                lambda name: [], probe_interval_s=1, probe_timeout_s=1)
        metrics = RouterMetrics()
        metrics.track_health(monitor)
        monitor.report_failure("decode-0", "gone")
        return metrics, monitor.get("decode-0").state

    metrics, state = asyncio.run(scenario())
    assert state is Health.UNHEALTHY
    value = metrics.registry.get_sample_value
    assert value("orch_instance_healthy", {"instance": "prefill-0", "role": "prefill"}) == 1
    assert value("orch_instance_healthy", {"instance": "decode-0", "role": "decode"}) == 0
    assert value("orch_health_transitions_total",
                 {"instance": "decode-0", "state": "unhealthy"}) == 1
    assert value("orch_health_transitions_total",
                 {"instance": "prefill-0", "state": "unhealthy"}) is None


def test_reduced_capacity_shows_in_status_and_metrics(capsys):
    """Two decode instances, one out of service: health stays SERVING, yet `orch status` and
    the metrics say the decode role runs at half capacity."""
    h = Harness(decode_dp=2)
    try:
        metrics = RouterMetrics()
        h.call_in_loop(lambda: metrics.track_health(h.monitor))
        fail(h, "decode-1", "rank 0 is gone (ActorDiedError)")
        assert serving(h.address) == health_pb2.HealthCheckResponse.SERVING
        assert cli.main(["status", "--address", h.address]) == cli.EXIT_UNHEALTHY
        out = capsys.readouterr().out
        assert "capacity: prefill 1/1 healthy, decode 1/2 healthy (reduced)" in out
        value = metrics.registry.get_sample_value
        assert value("orch_role_healthy_instances", {"role": "decode"}) == 1
        assert value("orch_role_instances", {"role": "decode"}) == 2
        assert value("orch_role_healthy_instances", {"role": "prefill"}) == 1
    finally:
        h.close()


def test_status_never_calls_an_instance_healthy_whose_rank_is_gone(harness):
    """One source of truth: a status look that finds a rank gone tells the monitor at once, and
    the row shows the monitor's verdict (never "healthy" beside a detail saying it is gone)."""
    from ray.exceptions import ActorDiedError

    def gone():
        raise ActorDiedError()

    fake = harness.fakes["decode-0"]
    fake.status = fake.node_info = gone
    with OrchClient(harness.address) as client:
        instances, _, _ = client.status(timeout_s=10)
    decode = instances[1]
    assert decode.health != "healthy", decode
    assert "is gone (ActorDiedError)" in decode.detail
    assert not harness.call_in_loop(lambda: harness.monitor.is_healthy("decode-0"))


def test_a_busy_leader_with_every_rank_answering_stays_healthy_and_says_so(harness):
    async def hang():
        await asyncio.Event().wait()

    harness.fakes["decode-0"].status = hang
    with OrchClient(harness.address) as client:
        instances, _, _ = client.status(timeout_s=10)
    decode = instances[1]
    assert decode.health == "healthy"
    assert "every rank answers pings" in decode.detail

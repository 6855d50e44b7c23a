"""Instance-choice policies."""

from __future__ import annotations

import pytest

from orchestrator.router.policies import LeastOutstandingTokens, RoundRobin, make_policy


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

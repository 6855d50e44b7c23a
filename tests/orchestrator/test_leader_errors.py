"""A failed leader call becomes one line: a dead or unreachable actor is told apart by its Ray
exception type (never by its message), a worker's own error by its first line."""

from __future__ import annotations

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from orchestrator.router.leader import _brief


def test_dead_or_unavailable_actor_says_the_rank_is_gone():
    for exc in (ActorDiedError(), ActorUnavailableError("unreachable", None)):
        line = _brief(exc)
        assert "a rank process of this instance is gone" in line, line
        assert "\n" not in line


def test_worker_error_is_its_first_line_even_when_it_mentions_actor_died():
    cause = ValueError("ActorDied is only a word here\nsecond line\n" + "x" * 1000)
    wrapped = RayTaskError("reserve", "traceback text", cause)
    line = _brief(wrapped)
    assert line == "ValueError: ActorDied is only a word here", line

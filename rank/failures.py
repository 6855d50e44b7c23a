"""How the leader tells a follower's failure apart from a failed step.

A follower whose actor died (``RayActorError`` on a Ray call; its step channel connection
closed or reset, rank/step_channel.py) is :class:`RankGone`; one that does not answer
within the bound is :class:`RankHung`. Either takes the instance out of service (see
rank/rank.py, Failures). A follower's method or step that raised (``RayTaskError``,
or the exception its step ack carries) is not a rank failure: the rank lives, and the error is
the step's.
"""

from __future__ import annotations

import time
from typing import Any


class RankFailure(RuntimeError):
    """A follower rank is dead or hung: the instance cannot step any more. The message names
    the rank and the cause."""


class RankGone(RankFailure):
    """A follower's actor died (``RayActorError``, or its step channel connection closed)."""


class RankHung(RankFailure):
    """A follower did not answer within the bound."""


def await_followers(refs: list, left_s: float, bound_s: float, what: str) -> list:
    """Results of the followers' ``refs`` (ranks 1.., in order), waiting ``left_s`` at most in
    all; a dead follower is reported as soon as Ray knows, whatever the others do.

    Args:
        refs: one Ray object ref per follower, rank 1 first.
        left_s: seconds left to wait.
        bound_s: the bound the messages name (seconds).
        what: what the followers run, for messages ("a step", "node_info").

    Raises:
        RankGone: a follower's actor died. RankHung: one did not answer in time.
        ray.exceptions.RayTaskError: a follower's method raised (the rank is alive).
    """
    if not refs:
        return []
    import ray

    rank_of = {ref: rank for rank, ref in enumerate(refs, start=1)}
    results: dict[int, Any] = {}
    deadline = time.monotonic() + left_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RankHung(f"rank {rank_of[pending[0]]} did not finish {what} within "
                           f"{bound_s:g} s (hung)")
        try:
            results[rank_of[ready[0]]] = ray.get(ready[0])
        except ray.exceptions.RayActorError as exc:
            raise RankGone(f"rank {rank_of[ready[0]]} is gone ({type(exc).__name__})") from exc
    return [results[rank] for rank in sorted(results)]

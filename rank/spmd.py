"""The leader's hand on every rank of its instance: one SPMD step on all of them, and bounded
calls of a role method on all of them.

A step goes over the step channel (rank/step_channel.py: one TCP connection per follower, no
Ray call per step): the leader sends the step to every follower, runs it itself, then reads
the followers' acks; the TP all-reduces inside the model keep the ranks in lock step. A rank
that does not ack within ``step_timeout_s`` fails the step. The leader records where each
step's time goes (rank/step_timing.py).

A rank-to-rank call names the role method it runs, never a string:
``call_all(PrefillRole.sends_idle, rids)`` runs ``PrefillRole.sends_idle(role, rids)`` on the
leader's own role and, through Ray (``Rank.role_call``, the function pickled by reference),
on every follower's. Failures are told apart as rank/failures.py says.

DeepSeek-V4 under TP: only the leader's block pool frees a request's blocks, but every rank's
runner holds the request's (whole) V4 cache; the leader takes what its runner released since
the last step (``LocalRank.take_releases``) and every rank, itself included, frees those
caches right before the step (:class:`StepSync`, riding in the step's frame), so all ranks'
V4 pools hold the same blocks at every step. A leader whose loop is idle takes no step: it has
every rank free them at once instead (:meth:`SPMDGroup.free_released`, an actor call to each
follower between steps).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from rank.failures import await_followers
from rank.step_channel import StepChannelLeader
from rank.step_timing import StepTimer

T = TypeVar("T")


@dataclass(frozen=True)
class StepSync:
    """A step frame's ``step_inputs`` when the leader's runner released requests since the
    last step: every follower frees ``released`` (request ids) before the step, then runs it
    with ``step_inputs`` (``rank.rank.Rank.execute_step``)."""

    step_inputs: Any
    released: tuple[str, ...]


class LocalRank(Protocol):
    """What the group needs of the leader's own rank (``rank.rank.Rank``)."""

    def take_releases(self) -> tuple[str, ...]: ...

    def free_released(self, released: tuple[str, ...]) -> None: ...

    def forward(self, steps: list, step_inputs: Any = None) -> torch.Tensor | None: ...

    def after_step(self, step_inputs: Any, output: Any = None) -> None: ...

    def role_call(self, fn: Callable[..., T], *args: Any) -> T: ...

    def process_info(self) -> tuple[str, str, int]: ...


class SPMDGroup:
    """The instance's ranks as the leader drives them.

    Args:
        local: the leader's own rank.
        peers: every rank's actor handle, rank order (``peers[0]`` is the leader itself).
        channel: the step channel's leader end (None without followers).
        timer: where the step phases are recorded.
        step_timeout_s: bound on one step, and the default bound of a call.
    """

    def __init__(self, local: LocalRank, peers: list, channel: StepChannelLeader | None,
                 timer: StepTimer, step_timeout_s: float) -> None:
        self.local, self.followers = local, list(peers[1:])
        self.channel, self.timer, self.step_timeout_s = channel, timer, step_timeout_s

    def run_step(self, steps: list, step_inputs: Any = None) -> torch.Tensor | None:
        """Run one step on all ranks; the leader's logits ``[B, V]`` (None when ``steps`` is
        empty: with ``ep`` an empty forward on every rank, else nothing).

        Phases recorded: fanout, forward, after_step, follower_wait.
        NOTE: the loop thread only (one step at a time on the step channel).

        Raises:
            RankFailure: a follower died or did not finish within ``step_timeout_s``.
            Exception: what the leader's step or a follower's raised (a follower's carries a
                note naming its rank).
        """
        timeout_s = self.step_timeout_s
        deadline = time.monotonic() + timeout_s
        timer, channel = self.timer, self.channel
        released = self.local.take_releases()
        if channel is not None:
            frame = StepSync(step_inputs, released) if released else step_inputs
            with timer.phase("fanout"):
                channel.run(steps, frame, deadline, timeout_s)
        try:
            self.local.free_released(released)
            with timer.phase("forward"):
                logits = self.local.forward(steps, step_inputs)
            with timer.phase("after_step"):
                self.local.after_step(step_inputs, logits)
        except Exception:
            # NOTE: a dead follower breaks the leader's collectives too: its own error wins.
            if channel is not None:
                channel.wait(deadline, timeout_s)
            raise
        if channel is not None:
            with timer.phase("follower_wait"):
                channel.wait(deadline, timeout_s)
        return logits

    def free_released(self) -> None:
        """Between steps, the leader's loop idle: every rank (each follower by an actor call,
        ``Rank.free_released``) frees now what the leader's runner released since the last
        step, each released id once (taken here, so no later step or rebuild carries it).
        Nothing to do: no call. NOTE: the loop thread only (no step runs meanwhile, so the
        ranks' V4 pools agree again before the next step).

        Raises:
            RankFailure: a follower died or did not answer within ``step_timeout_s``.
            Exception: what a rank's free raised.
        """
        released = self.local.take_releases()
        if not released:
            return
        deadline = time.monotonic() + self.step_timeout_s
        refs = [p.free_released.remote(released) for p in self.followers]
        self.local.free_released(released)
        await_followers(refs, deadline - time.monotonic(), self.step_timeout_s,
                        "freeing released requests")

    def take_releases(self) -> tuple[str, ...]:
        """The leader runner's releases to apply on every rank outside a step (a DeepSeek-V4
        rebuild: pass them to the rank-to-rank call, each rank frees them first)."""
        return self.local.take_releases()

    def call_all(self, fn: Callable[..., T], *args: Any,
                 timeout_s: float | None = None) -> list[T]:
        """``fn(role, *args)`` on every rank's role (the leader's locally), bounded by
        ``timeout_s`` (default ``step_timeout_s``); results in rank order. ``fn`` is a method
        of the role class (``DecodeRole.kv_status``).

        Raises:
            RankFailure: a follower died or did not answer in time.
            Exception: what the leader's call or a follower's (a ``RayTaskError``) raised.
        """
        bound = timeout_s or self.step_timeout_s
        deadline = time.monotonic() + bound
        refs = [p.role_call.remote(fn, *args) for p in self.followers]
        mine = self.local.role_call(fn, *args)
        return [mine, *await_followers(refs, deadline - time.monotonic(), bound, fn.__name__)]

    def ranks_info(self, timeout_s: float | None = None
                   ) -> tuple[tuple[int, str, str, int], ...]:
        """(rank, node id, device, pid) of every rank, for status.

        Raises:
            RankFailure: a rank is gone or did not answer within ``timeout_s``.
        """
        bound = timeout_s or self.step_timeout_s
        deadline = time.monotonic() + bound
        refs = [p.process_info.remote() for p in self.followers]
        infos = [self.local.process_info(),
                 *await_followers(refs, deadline - time.monotonic(), bound, "process_info")]
        return tuple((i, *info) for i, info in enumerate(infos))

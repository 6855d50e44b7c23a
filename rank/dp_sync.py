"""Lockstep of the DP ranks of an expert-parallel role: one agreement per model forward.

With ``ep`` on, every MoE layer of every forward runs all-to-alls over ALL ranks of the role
(DESIGN.md "Words"), so every DP rank (instance) must run the same number of forwards. The
role's ``dp`` leaders form a small group of their own (:class:`DPSync`), and before each
forward each leader says whether it has work; the answer is the MAX over the leaders, so
every leader decides the same thing from the same value:

- 1: every DP rank runs a forward on all its ranks; one with nothing scheduled runs an empty
  one (``ModelRunner.execute_empty`` on every rank) so the all-to-alls meet;
- 0: nobody runs a forward; each leader waits a little on its wake event and asks again.

A forward outside a normal round (the chunk-by-chunk re-run of a failed step, see
rank/leader.py) first opens a round of its own with ``any_work(True)``: the other
leaders meet it with their next round. Followers never take part: they run what their leader
tells them (the usual ``execute_step``).

Rendezvous: the role's EP store (opened by the role's first leader, see orchestrator/deploy/cluster.py),
under the prefix ``dp_sync`` (the EP group itself uses ``ep``). The group is Gloo on every
platform: one int per round, on the CPU.

Failures: every round is bounded by ``timeout_s`` (the instance's ``step_timeout_s``). A DP
rank that died or stopped stepping (out of service) never arrives: the others get
:class:`DPGroupBroken`, a :class:`RankFailure`, and go out of service too (the EP group is
broken for every DP rank of the role); the group is never used again.

Stopping: a leader whose loop ends (shutdown) leaves with one last round of value
:data:`STOPPING` (:meth:`DPSync.leave`). Every leader of the role meets it (MAX: all see it in
the same round), so one waiting in its idle round is released at once instead of after
``timeout_s``, and the others get :class:`DPGroupBroken` saying a DP rank stopped (they stop
too, or go out of service as above). A leader does no round after one that raised.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.error_text import first_line
from engine.network import gloo_devices
from rank.failures import RankFailure

log = logging.getLogger(__name__)

STORE_PREFIX = "dp_sync"
STOPPING = 2  # NOTE: a round's value when a leader leaves; above any has-work flag (0 / 1)


class DPGroupBroken(RankFailure):
    """Another DP rank of the expert-parallel role did not meet a round in time (dead, hung
    or out of service): the role's EP group cannot run a forward any more."""


class DPSync:
    """One leader's end of the role's leaders group.

    Args:
        group: Gloo process group of the ``size`` leaders (None when ``size == 1``).
        rank: this leader's DP rank; size: the role's ``dp``.
        timeout_s: bound on one round (seconds).
    """

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int,
                 timeout_s: float) -> None:
        self.group, self.rank, self.size, self.timeout_s = group, rank, size, timeout_s
        self.ended = False  # a round raised, or this leader left: no round any more

    def any_work(self, has_work: bool) -> bool:
        """One round: True when any leader of the role has work (``has_work`` is this
        leader's). Blocks until every leader asked (collective).

        Raises:
            DPGroupBroken: a leader did not arrive within ``timeout_s``, the group failed
                (a peer process is gone), another leader left (:meth:`leave`), or a round
                raised before.
        """
        if self.group is None:
            return has_work
        if self.ended:
            raise DPGroupBroken(f"DP rank {self.rank}: the role's EP group is broken (an "
                                "earlier lockstep round failed)")
        value = self._round(int(has_work))
        if value >= STOPPING:
            self.ended = True
            raise DPGroupBroken(f"DP rank {self.rank}: another DP rank of this expert-parallel "
                                "role stopped (shut down): the role's EP group is broken")
        return bool(value)

    def leave(self) -> None:
        """This leader stops stepping (its loop ended): one last round saying so (module
        docstring, Stopping), bounded by ``timeout_s``; nothing when the group is already
        broken or left. Never raises (a failed round is logged)."""
        if self.group is None or self.ended:
            return
        try:
            self._round(STOPPING)
        except DPGroupBroken as exc:
            log.debug("leaving the lockstep: %s", exc)
        self.ended = True

    def _round(self, value: int) -> int:
        """MAX of every leader's ``value`` (collective, bounded by ``timeout_s``).

        Raises:
            DPGroupBroken: see :meth:`any_work` (and the group is never used again).
        """
        flag = torch.tensor([value], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        try:
            self.group.allreduce([flag], opts).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            self.ended = True
            raise DPGroupBroken(
                f"DP rank {self.rank}: another DP rank of this expert-parallel role failed or did "
                f"not meet a step within {self.timeout_s:g} s (dead, hung or out of service): "
                f"the role's EP group is broken ({first_line(exc)})") from exc
        return int(flag.item())


def open_dp_sync(host: str, port: int, rank: int, size: int, timeout_s: float,
                 connect_timeout_s: float, store: dist.Store | None = None) -> DPSync:
    """Join the leaders group of a role with ``size`` DP ranks, on the EP store at
    ``host:port`` (``store``: a client of it already open, e.g. the store itself on the
    leader that opened it). Collective over the ``size`` leaders, who must all arrive within
    ``connect_timeout_s``; each round is then bounded by ``timeout_s``. Size 1 makes a group
    of one that never waits.

    Raises:
        ValueError: ``rank`` outside ``[0, size)``.
        torch.distributed.DistStoreError: the other leaders did not arrive in time.
    """
    if not 0 <= rank < size:
        raise ValueError(f"DP rank {rank} is outside a role of dp={size}")
    if size == 1:
        return DPSync(None, 0, 1, timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, is_master=False,
                              timeout=timedelta(seconds=connect_timeout_s))
    opts = dist.ProcessGroupGloo._Options()
    # NOTE: the rendezvous bound, and Gloo's own bound on an op: never shorter than a round's
    opts._timeout = timedelta(seconds=max(connect_timeout_s, timeout_s))
    opts._devices = gloo_devices(host)
    group = dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, size, opts)
    return DPSync(group, rank, size, timeout_s)

"""A rank's part in the protocol: the role object a :class:`rank.rank.Rank` holds.

The rank owns what every role shares (bring-up, model runner, step channel, loop thread,
out-of-service handling, status); the role says what to schedule and what to do around each
step. Three roles: ``prefill_worker.role.PrefillRole``, ``decode_worker.role.DecodeRole`` and
``rank.colocated.ColocatedRole``. Whoever creates the rank actors picks the role class by
``InstanceConfig.role`` and passes it to the rank (orchestrator/deploy/cluster.py); this
package never imports the workers.

Threads: Ray runs a rank's actor calls on several threads (``Rank.request``, ``Rank.poll``,
``Rank.status``, ``Rank.role_call``), the leader's loop thread runs :meth:`Role.step`, and a
follower's step channel thread runs :meth:`Role.after_step`. The leader's
:attr:`~rank.leader.Leader.lock` guards the scheduler, the pool and the role's own request
tables; a role never holds it across a call to other ranks (``call_all``), and ``Admit``
never takes it (decode queues the first token for the loop: it never waits for a step in
progress).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from engine.scheduler import RolePolicy
from rank.config import InstanceConfig
from rank.leader import Leader
from rank.messages import LeaderRequest


@dataclass(frozen=True)
class RankParts:
    """What a role is built from (``Rank.setup_role``, end of ``init_rank``).

    Attributes:
        cfg: the instance's config.
        rank: this rank's TP (or CP) rank; 0 is the leader.
        runner: the rank's ``engine.runner.ModelRunner`` (``kv_cache``, ``kv_spec``).
        leader: rank 0's shared state (scheduler, pool, events, step, the instance's ranks);
            None on a follower.
    """

    cfg: InstanceConfig
    rank: int
    runner: Any
    leader: Leader | None


class Role(ABC):
    """One role's protocol. Built on every rank, ``role_cls(parts)`` (``RankParts``), once
    the model is loaded and before the loop starts: it builds the role's state (KV connector;
    on the leader what it tracks besides the scheduler). A constructor that raises fails
    ``init_rank``, naming the rank; :meth:`close` is then never called.

    Class attributes: ``source``, the ``TokenEvent.source`` of the role's events (also its
    name: "prefill", "decode", "colocated"); ``policy``, the leader scheduler's role policy.
    Rank-to-rank calls are role methods passed as functions (``SPMDGroup.call_all``).
    """

    source: ClassVar[str]
    policy: ClassVar[RolePolicy]

    # ---- every rank ---------------------------------------------------------------------
    def after_step(self, step_inputs: Any, output: Any = None) -> None:
        """Right after this rank's model step: on the leader from the loop thread under the
        lock, on a follower on its step channel thread. ``step_inputs`` is what the leader's
        role made for the step (prefill: the chunks' KV transfers), None when it made none;
        ``output``: this rank's forward result (logits, a ``SpecOutput`` with MTP, or None).
        May queue work on this rank's own role state (KV sends); never the scheduler."""

    def layer_hook(self, step_inputs: Any) -> Callable[[int], None] | None:
        """Before this rank's model step, on the thread that runs it: what the forward calls
        with each layer's index right after that layer's KV write
        (``AttentionMetadata.on_kv_written``), or None (the default: nothing). The hook runs
        on the forward's thread while the step computes; it may queue work on this rank's
        own role state (prefill: the layer's KV sends), never block on other ranks."""
        return None

    def close(self) -> None:
        """End of ``Rank.shutdown``, every rank, once the loop thread stopped: release what the
        constructor opened (connectors, their threads and sockets)."""

    # ---- leader -------------------------------------------------------------------------
    def start(self) -> None:
        """``Rank.start``, before the loop thread starts (every rank is set up): what the
        role needs from the other ranks before serving (decode: their KV addresses).

        Raises:
            RankFailure: a rank is gone or did not answer.
        """

    @abstractmethod
    def handle(self, request: LeaderRequest) -> Any:
        """A router request (``Rank.request``, an actor call thread, not under the lock).
        Returns the request's answer (rank/messages.py says which).

        Raises:
            InstanceOutOfService: new work while the instance is out of service.
            TypeError: a request this role does not take (:func:`not_taken`).
        """

    @abstractmethod
    def step(self) -> bool:
        """One iteration of the leader's loop (loop thread, takes the lock itself); True when
        it did work (the loop then runs it again at once, else waits for a wake or 5 ms).

        Raises:
            RankFailure: a rank died or hung (the loop takes the instance out of service).
            Exception: anything else fails every request (``fail_all``); the loop lives on.
        """

    @abstractmethod
    def fail_all(self, error: str) -> None:
        """End every request of the instance with ``error`` (an instance failure: retryable
        elsewhere) and free its blocks once nothing can write them. Loop thread, lock not
        held, called while the instance is out of service or after a step raised. Never
        raises."""

    @abstractmethod
    def num_active(self) -> int:
        """Requests on this instance in any state (drain waits for 0). Any thread."""

    def status_fields(self, timeout_s: float | None) -> dict[str, Any]:
        """The role's :class:`~rank.messages.InstanceStatusInfo` fields by name (an actor
        call thread, not under the lock); it may ask every rank within ``timeout_s``, or
        (None: a rank is gone) report only the leader's own numbers.

        Raises:
            RankFailure: a rank is gone or did not answer.
        """
        return {}


def not_taken(role: Role, name: str, request: LeaderRequest) -> TypeError:
    """The error for a request ``role`` of instance ``name`` does not take."""
    return TypeError(f"{name} is a {role.source} instance: it does not take "
                     f"{type(request).__name__} (the router sent it to the wrong role)")

"""The PD protocol as a strategy object: how one request is placed, started and torn down.

Legal combinations, written once:

=============== =================================== ============================ ============
mode            place                               launch                       first token
=============== =================================== ============================ ============
disaggregated   decode.reserve -> Reservation       prefill.prefill(spec, res)   decode.admit
                (retryable Rejection: FIFO admission  (first token from prefill,   (or abort if
                queue; final one: INVALID_ARGUMENT)   the rest from decode)        it finished)
colocated       choose an instance                  colocated.generate(spec)     nothing
=============== =================================== ============================ ============

Disaggregated (:mod:`orchestrator.router.pd_flow`) with ``router.eager_prefill``
(DisaggregatedFlow ``eager``; while no request waits for decode room, never for a resumed
request): place sends ``prefill.prefill(spec, None)`` first, then reserves on decode while the
prompt computes; launch sends ``prefill.attach(res)`` (the KV computed so far ships then); a
first token that finished the request aborts the prefill as well as the reservation. With
``router.reserve_after_first_token`` (DisaggregatedFlow ``reserve_late``) place sends only the
prefill call; the first token streams as soon as it reaches the router, and only then does
decode reserve (the admission queue ahead of new arrivals), ``prefill.attach(res)`` ship the
prompt's KV and ``decode.admit`` start the decode; a first token that ended the request needs
no reservation at all.

Abort (client cancel, timeout, failure): prefill.abort (returns once no KV send is in flight
into the reservation) THEN decode.abort, so decode never frees blocks that are being written.

Failover: placement skips instances the policies report unhealthy, and tries instances that already
failed this request (``avoid``) last; a role with no healthy instance when chosen (also after
a wait for decode room: the reservation is kept) is waited for through ``place``'s ``ready``
(the router's ``Availability.wait``: while one is being restarted); a decode whose reserve
call fails (dead, timed out, raised) is skipped for the next one in the policy's order. A
failed leader call raises :class:`InstanceFailure` naming the instance; the router decides
whether to place again.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from rank.messages import Abort, Generate, LeaderRequest, Reservation
from engine.request import RequestSpec
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.leader import LeaderClient, LeaderError
from orchestrator.router.policies import Policy
from orchestrator.router.request import InstanceFailure, RequestError

log = logging.getLogger(__name__)

# NOTE: waits until every role (role -> its policy) has a healthy instance; Flow.place's ``ready``
Ready = Callable[[dict[str, Policy]], Awaitable[None]]


@dataclass
class Route:
    """Where one request runs and which load it still holds (mutable, router-owned)."""

    request_id: str
    # decode or colocated instance: where the request ends (None: a late reservation,
    # until the first token reached the router)
    main: str | None
    prefill: str | None = None
    prefill_load: int = 0  # load (Policy.load_for) charged to the prefill until first token
    main_load: int = 0  # load charged to the main instance until the end
    reservation: Reservation | None = None  # decode blocks (disaggregated), for launch
    # NOTE: an eager launch: the prefill call sent before the reservation (and when, monotonic)
    prefill_call: asyncio.Future | None = None
    launched_at: float | None = None
    # eager: the Attach's answer (None: not sent; False also: not to be sent, ended)
    attached: bool | None = None
    # a late reservation (``router.reserve_after_first_token``): what the reservation made
    # at the first token needs (kept once made); None when the route was placed whole
    late: "LateReservation | None" = None

    @property
    def instances(self) -> set[str]:
        return ({self.main} if self.main else set()) | ({self.prefill} if self.prefill else set())


@dataclass(frozen=True)
class LateReservation:
    """What decode's reservation after the first token needs: the attempt's ``spec``, its
    placement ``deadline`` (monotonic), the instances to try last (``avoid``) and ``watch``
    (the attempt's inbox widens to the decode chosen, before it is admitted)."""

    spec: RequestSpec
    deadline: float
    avoid: frozenset[str]
    watch: Callable[[set[str]], None]


class Flow(ABC):
    """One mode of serving a request. Methods run on the router's event loop.

    ``kv_index``: the router's view of the instances' prefix caches (fed by the event pump,
    read by ``kv_aware`` policies); None when no policy reads it.
    """

    kv_index: KVIndex | None = None

    def __init__(self, main: list[LeaderClient], policy: Policy) -> None:
        self.main = {leader.name: leader for leader in main}
        self.policy = policy

    @property
    def leaders(self) -> list[LeaderClient]:
        """Every leader that emits events or answers status()."""
        return list(self.main.values())

    def leader(self, name: str) -> LeaderClient:
        """The leader of instance ``name`` (KeyError for an unknown name)."""
        return {leader.name: leader for leader in self.leaders}[name]

    @property
    @abstractmethod
    def pools(self) -> dict[str, Policy]:
        """Role -> the policy choosing among its instances; a placement needs one of each."""

    def choices(self, policy: Policy, avoid: Collection[str], role: str,
                prompt_token_ids: Sequence[int] = ()) -> list[str]:
        """``policy.order(prompt_token_ids)`` (healthy instances only, see :class:`Policy`);
        those in ``avoid`` (they failed this request already) last.

        Raises:
            RequestError: UNAVAILABLE when no instance of ``role`` is healthy.
        """
        healthy = policy.order(prompt_token_ids)
        if not healthy:
            raise _none_healthy(policy, role)
        return [n for n in healthy if n not in avoid] + [n for n in healthy if n in avoid]

    async def _until_healthy(self, wait: Ready | None, *roles: str) -> None:
        """Return once each of ``roles`` has an instance its policy may choose: at once when
        they have, else after ``wait`` (role -> policy of those roles).

        Raises:
            RequestError: UNAVAILABLE when one has none and ``wait`` is None, or still none
                after it (it returns early on an abort: the router sees the abort mark);
                ``wait``'s error (none coming back, the deadline passed, shutdown).
        """
        pools = {role: self.pools[role] for role in roles}
        if wait is not None and not all(map(_any_healthy, pools.values())):
            await wait(pools)
        for role, policy in pools.items():
            if not _any_healthy(policy):
                raise _none_healthy(policy, role)

    @abstractmethod
    async def place(self, spec: RequestSpec, deadline: float, avoid: Collection[str] = (),
                    watch: Callable[[set[str]], None] | None = None,
                    ready: Ready | None = None) -> Route:
        """Choose healthy instances (``avoid`` last) and hold what the request needs.
        ``watch(instances)``: called before an instance is asked to compute during placement
        (an eager launch), so that its events reach the attempt. ``ready(pools)``: waits until
        every role in ``pools`` has a healthy instance (the router's ``Availability.wait``,
        bound to the request's deadline and abort mark); called whenever a role this
        placement needs has none at the moment it is chosen (None: UNAVAILABLE at once).

        Raises:
            RequestError: no capacity, never fits, no healthy instance (and none back in
                time), or cancelled.
        """

    @abstractmethod
    async def launch(self, spec: RequestSpec, route: Route) -> None:
        """Start computing; events follow on the leaders' event streams.

        Raises:
            InstanceFailure: the instance could not be called.
        """

    async def on_first_token(self, route: Route, token_id: int, finished: bool) -> None:
        """Called once when the first output token reached the router."""

    @abstractmethod
    async def abort(self, route: Route) -> None:
        """Stop the request everywhere and free its KV; logs failures, never raises."""

    def release(self, route: Route) -> None:
        """The request ended: give back its policy load (called exactly once)."""
        if route.main is not None:
            self.policy.release(route.main, route.main_load)
        route.main_load = 0

    def capacity(self, instance: str, free_blocks: int,
                 group_free: dict[str, int] | None = None) -> None:
        """A decode leader's event frame reported ``free_blocks`` free KV blocks and
        (DeepSeek-V4) ``group_free`` uncommitted blocks per KV group."""

    def health_changed(self) -> None:
        """An instance turned healthy or unhealthy (the health monitor's listener)."""

    def cancel_waiting(self, request_id: str, error: RequestError) -> bool:
        """End a request still being placed with ``error``; False when none is waiting."""
        return False

    def add_leader(self, leader: LeaderClient) -> None:
        """A new instance (live scaling) of ``leader.role``: placements may choose it."""
        self._members(leader.role)[leader.name] = leader
        self.pools[leader.role].add(leader.name)

    def remove_leader(self, name: str) -> LeaderClient:
        """Forget a drained instance (no load left on it); returns its leader.

        Raises:
            KeyError: no such instance. ValueError: it still carries load.
        """
        leader = self.leader(name)
        self.pools[leader.role].remove(name)
        return self._members(leader.role).pop(name)

    def _members(self, role: str) -> dict[str, LeaderClient]:
        """Name -> leader of ``role``'s instances."""
        return self.main

    def close_waiting(self, error: RequestError) -> None:
        """End every placement, now and later, with ``error`` (shutdown)."""

    def fail_waiting(self, error: RequestError) -> int:
        """End every placement waiting now with ``error`` (a role it needs is gone for
        good); how many were ended."""
        return 0


class ColocatedFlow(Flow):
    """Prefill and decode in the same instance: ``generate(spec)``, then its events."""

    @property
    def pools(self) -> dict[str, Policy]:
        return {"colocated": self.policy}

    async def place(self, spec: RequestSpec, deadline: float, avoid: Collection[str] = (),
                    watch: Callable[[set[str]], None] | None = None,
                    ready: Ready | None = None) -> Route:
        await self._until_healthy(ready, "colocated")
        name = self.choices(self.policy, avoid, "colocated", spec.prompt_token_ids)[0]
        load = self.policy.load_for(name, spec.max_total_tokens, spec.prompt_token_ids)
        self.policy.acquire(name, load)
        return Route(spec.request_id, main=name, main_load=load)

    async def launch(self, spec: RequestSpec, route: Route) -> None:
        await call_or_fail(self.main[route.main], Generate(spec))

    async def abort(self, route: Route) -> None:
        await abort_quietly(self.main[route.main], route.request_id)


def _any_healthy(policy: Policy) -> bool:
    return any(map(policy.healthy, policy.instances))


def _none_healthy(policy: Policy, role: str) -> RequestError:
    return RequestError("UNAVAILABLE", f"no healthy {role} instance "
                                       f"({', '.join(policy.instances)} out of service): "
                                       "retry later; `orch status` shows why")


async def call_or_fail(leader: LeaderClient, request: LeaderRequest) -> object:
    """A leader call whose failure is the instance's: raises :class:`InstanceFailure`."""
    try:
        return await leader.call(request)
    except LeaderError as exc:
        raise InstanceFailure(leader.name, str(exc)) from None


async def abort_quietly(leader: LeaderClient, request_id: str) -> None:
    """Abort ``request_id`` on ``leader``; a failed call is logged, not raised."""
    try:
        await leader.call(Abort(request_id))
    except LeaderError as exc:
        log.debug("abort of %s on %s failed: %s", request_id, leader.name, exc)

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

Disaggregated with ``router.eager_prefill`` (DisaggregatedFlow ``eager``; while no request
waits for decode room, never for a resumed request): place sends ``prefill.prefill(spec,
None)`` first, then reserves on decode while the prompt computes; launch sends
``prefill.attach(res)`` (the KV computed so far ships then); a first token that finished the
request aborts the prefill as well as the reservation.

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
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from rank.messages import (Abort, Admit, Attach, Generate, LeaderRequest, Prefill, Rejection,
                           Reservation, Reserve)
from engine.request import RequestSpec
from orchestrator.router.admission import AdmissionQueue
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
    main: str  # decode or colocated instance: where the request ends
    prefill: str | None = None
    prefill_load: int = 0  # load (Policy.load_for) charged to the prefill until first token
    main_load: int = 0  # load charged to the main instance until the end
    reservation: Reservation | None = None  # decode blocks (disaggregated), for launch
    # NOTE: an eager launch: the prefill call sent before the reservation (and when, monotonic)
    prefill_call: asyncio.Future | None = None
    launched_at: float | None = None
    # eager: the Attach's answer (None: not sent; False also: not to be sent, ended)
    attached: bool | None = None

    @property
    def instances(self) -> set[str]:
        return {self.main} | ({self.prefill} if self.prefill else set())


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
        await _call_or_fail(self.main[route.main], Generate(spec))

    async def abort(self, route: Route) -> None:
        await _abort_quietly(self.main[route.main], route.request_id)


class DisaggregatedFlow(Flow):
    """Decode reserves first, prefill computes into the reservation, decode admits.

    Args:
        prefill, decode: leaders of each role.
        prefill_policy, decode_policy: instance choice per role.
        admission: bounded queue of requests waiting for decode KV blocks.
        prefill_tp, prefill_cp: TP and CP sizes of every prefill instance (decode ranks plan
            their receives by them).
        eager: launch the prefill before the reservation while no request waits for decode
            room: the prompt computes while decode reserves, its KV ships on ``Attach``
            (prefill_worker/role.py ``attach``; not with V4, MTP or cp > 1).
    """

    def __init__(self, prefill: list[LeaderClient], decode: list[LeaderClient],
                 prefill_policy: Policy, decode_policy: Policy,
                 admission: AdmissionQueue, prefill_tp: int = 1, prefill_cp: int = 1,
                 eager: bool = False) -> None:
        super().__init__(decode, decode_policy)
        self.prefill_tp, self.prefill_cp, self.eager = prefill_tp, prefill_cp, eager
        self.prefill = {leader.name: leader for leader in prefill}
        self.prefill_policy = prefill_policy
        self.admission = admission
        admission.order = decode_policy.order
        self._aborts: set[asyncio.Task] = set()  # aborts of reserves that failed

    @property
    def leaders(self) -> list[LeaderClient]:
        return list(self.prefill.values()) + list(self.main.values())

    @property
    def pools(self) -> dict[str, Policy]:
        return {"prefill": self.prefill_policy, "decode": self.policy}

    async def place(self, spec: RequestSpec, deadline: float, avoid: Collection[str] = (),
                    watch: Callable[[set[str]], None] | None = None,
                    ready: Ready | None = None) -> Route:
        await self._until_healthy(ready, "prefill", "decode")  # NOTE: before reserving anything
        # NOTE: eager only while nobody waits for decode room: a prompt computed ahead would
        # hold prefill blocks through the wait, and overtake the waiters on prefill
        if self.eager and watch is not None and not spec.num_resumed_tokens \
                and not self.admission.ahead_of(False):
            return await self._place_eager(spec, deadline, avoid, watch)
        decode, reservation = await self._reserve(spec, deadline, avoid)
        route = Route(spec.request_id, main=decode, main_load=spec.max_total_tokens,
                      reservation=reservation)
        try:
            # NOTE: the prefill may have died while the request waited for decode room: the
            # request keeps its reservation (and so its turn) while waiting for the restart
            # (decode keeps an unadmitted one 4 x completion_timeout_s, decode_worker/role.py)
            await self._until_healthy(ready, "prefill")
            route.prefill = self.choices(self.prefill_policy, avoid, "prefill",
                                         spec.prompt_token_ids)[0]
        except BaseException:  # NOTE: also cancelled: the reservation is freed once, here
            self.release(route)
            await asyncio.shield(self.abort(route))
            raise
        route.prefill_load = self.prefill_policy.load_for(
            route.prefill, spec.num_prompt_tokens, spec.prompt_token_ids)
        self.prefill_policy.acquire(route.prefill, route.prefill_load)
        return route

    async def _place_eager(self, spec: RequestSpec, deadline: float, avoid: Collection[str],
                           watch: Callable[[set[str]], None]) -> Route:
        """The prefill call goes out first, the reservation is made while the prompt
        computes; on any failure to reserve the prefill is aborted (its blocks freed there
        once) and the error raised."""
        prefill = self.choices(self.prefill_policy, avoid, "prefill", spec.prompt_token_ids)[0]
        load = self.prefill_policy.load_for(prefill, spec.num_prompt_tokens,
                                            spec.prompt_token_ids)
        self.prefill_policy.acquire(prefill, load)
        watch({prefill})
        launched_at = time.monotonic()
        call = asyncio.ensure_future(_call_or_fail(self.prefill[prefill], Prefill(spec, None)))
        call.add_done_callback(_consume)  # NOTE: a route aborted before launch never awaits it
        try:
            # NOTE: the call's task sends at its first step, the reserve's send comes before
            # the reserve's first await: yielding once runs that step first (the loop runs
            # ready callbacks in order), so the prompt starts one send earlier (~1 ms here)
            await asyncio.sleep(0)
            decode, reservation = await self._reserve(spec, deadline, avoid)
        except BaseException:
            self.prefill_policy.release(prefill, load)
            # NOTE: an abort before the call arrives leaves a tombstone: the call is refused
            await asyncio.shield(_abort_quietly(self.prefill[prefill], spec.request_id))
            raise
        return Route(spec.request_id, main=decode, prefill=prefill,
                     prefill_load=load, main_load=spec.max_total_tokens,
                     reservation=reservation, prefill_call=call, launched_at=launched_at)

    async def _reserve(self, spec: RequestSpec, deadline: float,
                       avoid: Collection[str]) -> tuple[str, Reservation]:
        """Reserve on the first decode that can; while all are full, or others already wait,
        wait in the admission queue (FIFO) for a decode that reports room. A decode whose call
        fails is skipped (UNAVAILABLE when every one failed)."""
        migrating = spec.num_resumed_tokens > 0  # NOTE: queued ahead of new arrivals
        async with self.admission.ticket(spec.request_id, migrating) as ticket:
            # NOTE: behind earlier waiters a request tries nothing: it would overtake them
            direct = not self.admission.ahead_of(migrating)
            names = self.choices(self.policy, avoid, "decode", spec.prompt_token_ids) \
                if direct else []
            while True:
                got, full, failures = await self._try_reserve(spec, names)
                if got is not None:
                    ticket.reserved = True
                    return got
                if direct and full is None:
                    raise RequestError("UNAVAILABLE", "no decode instance could reserve: "
                                       f"{failures}: retry later; `orch status` shows the "
                                       "instances")
                if full is None:
                    why, need, groups = f"{self.admission.waiting} request(s) wait ahead", \
                        None, None
                else:
                    why, need = full.reason, full.blocks_needed or None
                    groups = dict(full.group_blocks_needed)
                names = [await ticket.wait(deadline, why, need, groups)]
                direct = False

    async def _try_reserve(self, spec: RequestSpec, names: list[str]
                           ) -> tuple[tuple[str, Reservation] | None, Rejection | None, str]:
        """Reserve on the first of ``names`` that can: ((name, reservation) or None, the last
        retryable refusal (None: none was full), the failed calls' messages).

        Raises:
            RequestError: INVALID_ARGUMENT when a decode says it can never fit; the abort
                error when the request was cancelled.
        """
        full, failures = None, []
        for name in names:
            self.admission.check(spec.request_id)  # aborted: stop trying
            try:
                answer = await self._reserve_on(name, spec)
            except InstanceFailure as exc:
                # NOTE: debug: the instance's failure is logged once, not per request
                log.debug("reserve of %s: %s; trying the next decode instance",
                          spec.request_id, exc.message)
                self.admission.lost(name)
                failures.append(exc.message)
                continue
            if isinstance(answer, Reservation):
                return (name, answer), None, ""
            if not answer.retryable:
                raise RequestError("INVALID_ARGUMENT", f"{name}: {answer.reason}")
            full = answer
            self.admission.full(name, max(1, answer.blocks_needed),
                                dict(answer.group_blocks_needed))
        return None, full, "; ".join(failures)

    async def _reserve_on(self, name: str, spec: RequestSpec) -> Reservation | Rejection:
        """One reserve call; the policy load stays charged only on success."""
        # NOTE: charge the load before awaiting, so concurrent placements already see it.
        self.policy.acquire(name, spec.max_total_tokens)
        answer = None
        try:
            answer = await _call_or_fail(self.main[name],
                                         Reserve(spec, self.prefill_tp, self.prefill_cp))
        except (InstanceFailure, asyncio.CancelledError):
            # NOTE: a reserve that timed out, was abandoned or cancelled may still have
            # reserved. Aborted in the background: a hung instance must not hold up the next.
            task = asyncio.create_task(_abort_quietly(self.main[name], spec.request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        finally:
            if not isinstance(answer, Reservation):
                self.policy.release(name, spec.max_total_tokens)
        return answer

    async def launch(self, spec: RequestSpec, route: Route) -> None:
        leader = self.prefill[route.prefill]
        if route.prefill_call is None:
            await _call_or_fail(leader, Prefill(spec, route.reservation))
            return
        await route.prefill_call  # NOTE: raises its InstanceFailure
        if route.attached is not None:
            return  # NOTE: ended at its first token (on_first_token): nothing to ship
        route.attached = await _call_or_fail(leader, Attach(spec.request_id, route.reservation))
        if not route.attached:
            # NOTE: the prefill ended it (aborted, failed, or its computed prompt held past
            # ORPHAN_FACTOR completion timeouts): decode would wait for KV that never comes
            raise RequestError("UNAVAILABLE", f"{route.prefill}: request {spec.request_id} "
                               "was gone when its decode reservation was attached (aborted, "
                               "failed, or held longer than 4 x kv_transfer."
                               "completion_timeout_s): retry")

    async def on_first_token(self, route: Route, token_id: int, finished: bool) -> None:
        self._release_prefill(route)
        decode = self.main[route.main]
        if finished:  # NOTE: max_tokens == 1 or EOS: the reservation is no longer needed
            if route.prefill_call is not None:
                # NOTE: eager: no Attach from now on (launch sees this); the prefill frees
                # its computed prompt, or, if the Attach got there first, stops its sends
                if route.attached is None:
                    route.attached = False
                await _abort_quietly(self.prefill[route.prefill], route.request_id)
            await _abort_quietly(decode, route.request_id)
            return
        await _call_or_fail(decode, Admit(route.request_id, token_id))

    async def abort(self, route: Route) -> None:
        if route.prefill:
            await _abort_quietly(self.prefill[route.prefill], route.request_id)
        await _abort_quietly(self.main[route.main], route.request_id)

    def release(self, route: Route) -> None:
        self._release_prefill(route)
        super().release(route)

    def capacity(self, instance: str, free_blocks: int,
                 group_free: dict[str, int] | None = None) -> None:
        self.admission.report(instance, free_blocks, group_free)

    def health_changed(self) -> None:
        # NOTE: a restarted decode may report its room before the monitor calls it healthy
        self.admission.regrant()

    def cancel_waiting(self, request_id: str, error: RequestError) -> bool:
        return self.admission.cancel(request_id, error)

    def _members(self, role: str) -> dict[str, LeaderClient]:
        return self.prefill if role == "prefill" else self.main

    def close_waiting(self, error: RequestError) -> None:
        self.admission.close(error)

    def _release_prefill(self, route: Route) -> None:
        if route.prefill and route.prefill_load:
            self.prefill_policy.release(route.prefill, route.prefill_load)
            route.prefill_load = 0


def _consume(task: asyncio.Future) -> None:
    """Retrieve a finished task's outcome (nobody awaits it)."""
    if not task.cancelled():
        task.exception()


def _any_healthy(policy: Policy) -> bool:
    return any(map(policy.healthy, policy.instances))


def _none_healthy(policy: Policy, role: str) -> RequestError:
    return RequestError("UNAVAILABLE", f"no healthy {role} instance "
                                       f"({', '.join(policy.instances)} out of service): "
                                       "retry later; `orch status` shows why")


async def _call_or_fail(leader: LeaderClient, request: LeaderRequest) -> object:
    """A leader call whose failure is the instance's: raises :class:`InstanceFailure`."""
    try:
        return await leader.call(request)
    except LeaderError as exc:
        raise InstanceFailure(leader.name, str(exc)) from None


async def _abort_quietly(leader: LeaderClient, request_id: str) -> None:
    try:
        await leader.call(Abort(request_id))
    except LeaderError as exc:
        log.debug("abort of %s on %s failed: %s", request_id, leader.name, exc)

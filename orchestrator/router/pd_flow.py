"""The disaggregated flow: decode reserves KV blocks, prefill computes into them, decode admits.

The protocol (and eager prefill, aborts, failover) is the table in :mod:`orchestrator.router.flow`;
this is its PD strategy: the reservation (through the FIFO admission queue when decode is full),
the eager launch that computes the prompt while decode reserves, ``Attach``, and the abort
order (prefill first, then decode, so decode never frees blocks being written).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection

from rank.messages import Admit, Attach, Prefill, Rejection, Reservation, Reserve
from engine.request import RequestSpec
from orchestrator.router.admission import AdmissionQueue
from orchestrator.router.flow import (Flow, LateReservation, Ready, Route, abort_quietly,
                                      call_or_fail)
from orchestrator.router.leader import LeaderClient
from orchestrator.router.policies import Policy
from orchestrator.router.request import InstanceFailure, RequestError

log = logging.getLogger(__name__)


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
        reserve_late: with ``eager``, reserve on decode only once the first token reached
            the router (it streams at once; :meth:`on_first_token` reserves, attaches and
            admits), so nothing of the reservation runs beside the prompt's forward.
    """

    def __init__(self, prefill: list[LeaderClient], decode: list[LeaderClient],
                 prefill_policy: Policy, decode_policy: Policy,
                 admission: AdmissionQueue, prefill_tp: int = 1, prefill_cp: int = 1,
                 eager: bool = False, reserve_late: bool = False) -> None:
        super().__init__(decode, decode_policy)
        self.prefill_tp, self.prefill_cp, self.eager = prefill_tp, prefill_cp, eager
        self.reserve_late = eager and reserve_late
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
        # hold prefill blocks through the wait, and overtake the waiters on prefill. A late
        # reservation's request that ends at its first token never asks decode: no wait
        if self.eager and watch is not None and not spec.num_resumed_tokens \
                and (not self.admission.ahead_of(False) or self._prefill_only(spec)):
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

    def _prefill_only(self, spec: RequestSpec) -> bool:
        """Whether ``spec`` never needs decode: with ``reserve_late`` its first token ends it
        (``max_tokens`` 1), so nothing is reserved (:meth:`_reserve_then_admit`)."""
        return self.reserve_late and spec.sampling.max_tokens == 1

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
        call = asyncio.ensure_future(call_or_fail(self.prefill[prefill], Prefill(spec, None)))
        call.add_done_callback(_consume)  # NOTE: a route aborted before launch never awaits it
        if self.reserve_late:  # NOTE: decode reserves at the first token (on_first_token)
            return Route(spec.request_id, main=None, prefill=prefill, prefill_load=load,
                         prefill_call=call, launched_at=launched_at,
                         late=LateReservation(spec, deadline, frozenset(avoid), watch))
        try:
            # NOTE: the call's task sends at its first step, the reserve's send comes before
            # the reserve's first await: yielding once runs that step first (the loop runs
            # ready callbacks in order), so the prompt starts one send earlier (~1 ms here)
            await asyncio.sleep(0)
            decode, reservation = await self._reserve(spec, deadline, avoid, computed=True)
        except BaseException:
            self.prefill_policy.release(prefill, load)
            # NOTE: an abort before the call arrives leaves a tombstone: the call is refused
            await asyncio.shield(abort_quietly(self.prefill[prefill], spec.request_id))
            raise
        return Route(spec.request_id, main=decode, prefill=prefill,
                     prefill_load=load, main_load=spec.max_total_tokens,
                     reservation=reservation, prefill_call=call, launched_at=launched_at)

    async def _reserve(self, spec: RequestSpec, deadline: float, avoid: Collection[str],
                       streamed: bool = False, computed: bool = False
                       ) -> tuple[str, Reservation]:
        """Reserve on the first decode that can; while all are full, or others already wait,
        wait in the admission queue (FIFO by level) for a decode that reports room. A decode
        whose call fails is skipped (UNAVAILABLE when every one failed). ``streamed``: the
        client has tokens already (a late reservation): queued ahead of new arrivals, as a
        migration; ``computed``: the prompt is computed (eager): ahead of those too."""
        # NOTE: queued ahead of new arrivals
        migrating = spec.num_resumed_tokens > 0 or streamed
        async with self.admission.ticket(spec.request_id, migrating, computed) as ticket:
            # NOTE: behind earlier waiters a request tries nothing: it would overtake them
            direct = not self.admission.ahead_of(migrating, computed)
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
            answer = await call_or_fail(self.main[name],
                                         Reserve(spec, self.prefill_tp, self.prefill_cp))
        except (InstanceFailure, asyncio.CancelledError):
            # NOTE: a reserve that timed out, was abandoned or cancelled may still have
            # reserved. Aborted in the background: a hung instance must not hold up the next.
            task = asyncio.create_task(abort_quietly(self.main[name], spec.request_id))
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
            await call_or_fail(leader, Prefill(spec, route.reservation))
            return
        await route.prefill_call  # NOTE: raises its InstanceFailure
        # NOTE: a late reservation attaches in on_first_token, whenever this call's answer
        # comes (the token stream may bring the first token first)
        if route.late is not None or route.attached is not None:
            return  # NOTE: ended at its first token (on_first_token): nothing to ship
        if not await self._attach(route, leader):
            raise RequestError("UNAVAILABLE", f"{_gone(route)}: retry")

    async def on_first_token(self, route: Route, token_id: int, finished: bool) -> None:
        self._release_prefill(route)
        if route.late is not None:
            await self._reserve_then_admit(route, token_id, finished)
            return
        decode = self.main[route.main]
        if finished:  # NOTE: max_tokens == 1 or EOS: the reservation is no longer needed
            if route.prefill_call is not None:
                # NOTE: eager: no Attach from now on (launch sees this); the prefill frees
                # its computed prompt, or, if the Attach got there first, stops its sends
                if route.attached is None:
                    route.attached = False
                await abort_quietly(self.prefill[route.prefill], route.request_id)
            await abort_quietly(decode, route.request_id)
            return
        await call_or_fail(decode, Admit(route.request_id, token_id))

    async def _reserve_then_admit(self, route: Route, token_id: int, finished: bool) -> None:
        """A late reservation, once the first token reached the router: none when it ended
        the request (the prefill frees its computed prompt); else reserve on decode (ahead of
        new arrivals in the admission queue), ``Attach`` (the prompt's KV ships), ``Admit``.

        Raises:
            RequestError: no decode could reserve (UNAVAILABLE, RESOURCE_EXHAUSTED), or the
                prefill had dropped the request (UNAVAILABLE).
            InstanceFailure: the prefill or the decode failed a call.
        """
        late, prefill = route.late, self.prefill[route.prefill]
        if finished:
            route.attached = False  # NOTE: launch sends no Attach
            await abort_quietly(prefill, route.request_id)
            return
        decode, route.reservation = await self._reserve(late.spec, late.deadline,
                                                        late.avoid, streamed=True,
                                                        computed=True)
        route.main, route.main_load = decode, late.spec.max_total_tokens
        late.watch({decode})  # NOTE: before Admit: decode's tokens must reach the attempt
        if not await self._attach(route, prefill):
            # NOTE: the KV is lost (e.g. the prefill was restarted while decode reserved):
            # the client has its token, so the request migrates (prompt + that token)
            raise InstanceFailure(route.prefill, _gone(route))
        await call_or_fail(self.main[decode], Admit(route.request_id, token_id))

    async def _attach(self, route: Route, prefill: LeaderClient) -> bool:
        """``Attach`` the reservation to the prompt computed on ``prefill``; False when the
        prefill no longer had the request (aborted, failed, restarted, or its computed prompt
        held past 4 x ``kv_transfer.completion_timeout_s``): decode would wait for KV that
        never comes.

        Raises:
            InstanceFailure: the call failed.
        """
        route.attached = await call_or_fail(prefill, Attach(route.request_id,
                                                            route.reservation))
        return route.attached

    async def abort(self, route: Route) -> None:
        if route.prefill:
            await abort_quietly(self.prefill[route.prefill], route.request_id)
        if route.main is not None:
            await abort_quietly(self.main[route.main], route.request_id)

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

    def fail_waiting(self, error: RequestError) -> int:
        return self.admission.fail_waiting(error)

    def _release_prefill(self, route: Route) -> None:
        if route.prefill and route.prefill_load:
            self.prefill_policy.release(route.prefill, route.prefill_load)
            route.prefill_load = 0



def _gone(route: Route) -> str:
    return (f"{route.prefill}: request {route.request_id} was gone when its decode reservation "
            "was attached (aborted, failed, restarted, or held longer than 4 x "
            "kv_transfer.completion_timeout_s)")


def _consume(task: asyncio.Future) -> None:
    """Retrieve a finished task's outcome (nobody awaits it)."""
    if not task.cancelled():
        task.exception()

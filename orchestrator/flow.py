"""The PD protocol as a strategy object: how one request is placed, started and torn down.

Legal combinations, written once:

=============== =================================== ============================ ============
mode            place                               launch                       first token
=============== =================================== ============================ ============
disaggregated   decode.reserve -> Reservation       prefill.prefill(spec, res)   decode.admit
                (retryable Rejection: admission       (first token from prefill,   (or abort if
                queue; final one: INVALID_ARGUMENT)   the rest from decode)        it finished)
colocated       choose an instance                  colocated.generate(spec)     nothing
=============== =================================== ============================ ============

Abort (client cancel, timeout, failure): prefill.abort (returns once no KV send is in flight
into the reservation) THEN decode.abort, so decode never frees blocks that are being written.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

from prefill_worker.messages import Rejection, RequestSpec, Reservation
from orchestrator.admission import AdmissionQueue
from orchestrator.leader import LeaderClient, LeaderError
from orchestrator.policies import Policy
from orchestrator.request import RequestError

log = logging.getLogger(__name__)


@dataclass
class Route:
    """Where one request runs and which load it still holds (mutable, router-owned)."""

    request_id: str
    main: str  # decode or colocated instance: where the request ends
    prefill: str | None = None
    prefill_load: int = 0  # prompt tokens charged to the prefill instance until first token
    main_load: int = 0  # prompt + max_tokens charged to the main instance until the end
    reservation: Reservation | None = None  # decode blocks (disaggregated), for launch

    @property
    def instances(self) -> set[str]:
        return {self.main} | ({self.prefill} if self.prefill else set())


class Flow(ABC):
    """One mode of serving a request. Methods run on the router's event loop."""

    def __init__(self, main: list[LeaderClient], policy: Policy) -> None:
        self.main = {leader.name: leader for leader in main}
        self.policy = policy

    @property
    def leaders(self) -> list[LeaderClient]:
        """Every leader that emits events or answers status()."""
        return list(self.main.values())

    @abstractmethod
    async def place(self, spec: RequestSpec, deadline: float) -> Route:
        """Choose instances and hold what the request needs (raises RequestError)."""

    @abstractmethod
    async def launch(self, spec: RequestSpec, route: Route) -> None:
        """Start computing; events follow through the leaders' poll()."""

    async def on_first_token(self, route: Route, token_id: int, finished: bool) -> None:
        """Called once when the first output token reached the router."""

    @abstractmethod
    async def abort(self, route: Route) -> None:
        """Stop the request everywhere and free its KV; logs failures, never raises."""

    def release(self, route: Route) -> None:
        """The request ended: give back its policy load (called exactly once)."""
        self.policy.release(route.main, route.main_load)
        route.main_load = 0

    def cancel_waiting(self, request_id: str, error: RequestError) -> bool:
        """End a request still being placed with ``error``; False when none is waiting."""
        return False

    def close_waiting(self, error: RequestError) -> None:
        """End every placement, now and later, with ``error`` (shutdown)."""


class ColocatedFlow(Flow):
    """Prefill and decode in the same instance: ``generate(spec)`` then events from poll()."""

    async def place(self, spec: RequestSpec, deadline: float) -> Route:
        name = _healthy(self.policy, "colocated")[0]
        self.policy.acquire(name, spec.max_total_tokens)
        return Route(spec.request_id, main=name, main_load=spec.max_total_tokens)

    async def launch(self, spec: RequestSpec, route: Route) -> None:
        await _call_or_fail(self.main[route.main], "generate", spec)

    async def abort(self, route: Route) -> None:
        await _abort_quietly(self.main[route.main], route.request_id)


class DisaggregatedFlow(Flow):
    """Decode reserves first, prefill computes into the reservation, decode admits.

    Args:
        prefill, decode: leaders of each role.
        prefill_policy, decode_policy: instance choice per role.
        admission: bounded queue of requests waiting for decode KV blocks.
        prefill_tp: TP size of every prefill instance (decode ranks plan their receives by it).
    """

    def __init__(self, prefill: list[LeaderClient], decode: list[LeaderClient],
                 prefill_policy: Policy, decode_policy: Policy,
                 admission: AdmissionQueue, prefill_tp: int = 1) -> None:
        super().__init__(decode, decode_policy)
        self.prefill_tp = prefill_tp
        self.prefill = {leader.name: leader for leader in prefill}
        self.prefill_policy = prefill_policy
        self.admission = admission

    @property
    def leaders(self) -> list[LeaderClient]:
        return list(self.prefill.values()) + list(self.main.values())

    async def place(self, spec: RequestSpec, deadline: float) -> Route:
        _healthy(self.prefill_policy, "prefill")  # NOTE: fail before holding decode blocks
        decode, reservation = await self._reserve(spec, deadline)
        try:
            prefill = _healthy(self.prefill_policy, "prefill")[0]
        except RequestError:
            await _abort_quietly(self.main[decode], spec.request_id)
            self.policy.release(decode, spec.max_total_tokens)
            raise
        self.prefill_policy.acquire(prefill, spec.num_prompt_tokens)
        return Route(spec.request_id, main=decode, prefill=prefill,
                     prefill_load=spec.num_prompt_tokens, main_load=spec.max_total_tokens,
                     reservation=reservation)

    async def _reserve(self, spec: RequestSpec, deadline: float) -> tuple[str, Reservation]:
        async with self.admission.ticket(spec.request_id) as ticket:
            while True:
                rejection: Rejection | None = None
                for name in _healthy(self.policy, "decode"):
                    answer = await self._reserve_on(name, spec)
                    if isinstance(answer, Reservation):
                        return name, answer
                    if not answer.retryable:
                        raise RequestError("INVALID_ARGUMENT", f"{name}: {answer.reason}")
                    rejection = answer
                await ticket.wait(deadline, rejection.reason if rejection else "")

    async def _reserve_on(self, name: str, spec: RequestSpec) -> Reservation | Rejection:
        """One reserve call; the policy load stays charged only on success."""
        # NOTE: charge the load before awaiting, so concurrent placements already see it.
        self.policy.acquire(name, spec.max_total_tokens)
        answer = None
        try:
            answer = await _call_or_fail(self.main[name], "reserve", spec, self.prefill_tp)
        except (RequestError, asyncio.CancelledError):
            # NOTE: a reserve that timed out or was cancelled may still have reserved.
            await _abort_quietly(self.main[name], spec.request_id)
            raise
        finally:
            if not isinstance(answer, Reservation):
                self.policy.release(name, spec.max_total_tokens)
        return answer

    async def launch(self, spec: RequestSpec, route: Route) -> None:
        await _call_or_fail(self.prefill[route.prefill], "prefill", spec, route.reservation)

    async def on_first_token(self, route: Route, token_id: int, finished: bool) -> None:
        self._release_prefill(route)
        decode = self.main[route.main]
        if finished:  # NOTE: max_tokens == 1 or EOS: the reservation is no longer needed
            await _abort_quietly(decode, route.request_id)
            self.admission.notify()
            return
        await _call_or_fail(decode, "admit", route.request_id, token_id)

    async def abort(self, route: Route) -> None:
        if route.prefill:
            await _abort_quietly(self.prefill[route.prefill], route.request_id)
        await _abort_quietly(self.main[route.main], route.request_id)

    def release(self, route: Route) -> None:
        self._release_prefill(route)
        super().release(route)
        self.admission.notify()

    def cancel_waiting(self, request_id: str, error: RequestError) -> bool:
        return self.admission.cancel(request_id, error)

    def close_waiting(self, error: RequestError) -> None:
        self.admission.close(error)

    def _release_prefill(self, route: Route) -> None:
        if route.prefill and route.prefill_load:
            self.prefill_policy.release(route.prefill, route.prefill_load)
            route.prefill_load = 0


def _healthy(policy: Policy, role: str) -> list[str]:
    """``policy.order()`` (healthy instances, best first).

    Raises:
        RequestError: UNAVAILABLE when no instance of ``role`` is healthy.
    """
    order = policy.order()
    if not order:
        raise RequestError("UNAVAILABLE", f"no healthy {role} instance "
                                          f"({', '.join(policy.instances)} out of service): "
                                          "retry later; `orch status` shows why")
    return order


async def _call_or_fail(leader: LeaderClient, method: str, *args: object) -> object:
    """A leader call whose failure fails the request with UNAVAILABLE."""
    try:
        return await leader.call(method, *args)
    except LeaderError as exc:
        raise RequestError("UNAVAILABLE", str(exc)) from None


async def _abort_quietly(leader: LeaderClient, request_id: str) -> None:
    try:
        await leader.call("abort", request_id)
    except LeaderError as exc:
        log.warning("abort of %s on %s failed: %s", request_id, leader.name, exc)

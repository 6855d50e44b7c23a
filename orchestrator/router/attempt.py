"""A request's attempts: the router-side state of one client request (:class:`InFlight`)
and of one placement of it under its own id (:class:`Attempt`).

Attempt ids are router-unique ("<request_id>@<n>", n counts every attempt of the router):
the workers, the pump and the tombstones only ever see them, so a client reusing an id, or a
request placed again after a failure, never receives another attempt's late events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from rank.messages import TokenEvent
from engine.request import RequestSpec
from orchestrator.router.flow import Flow, Route
from orchestrator.router.leader import EventPump
from orchestrator.router.request import InstanceFailure, RequestError


@dataclass
class InFlight:
    """One client request inside the router, from acceptance to its last message.

    Attributes:
        request_id: the client's id (what OutputChunk and Abort carry).
        attempt_id: the current attempt's id: "" before the first placement.
        route: the current attempt's route (None before it is placed).
        aborted: an Abort arrived; every later step checks it.
        avoid: instances that failed this request (tried last on the next attempt).
        failures: one line per failed attempt.
    """

    request_id: str
    attempt_id: str = ""
    route: Route | None = None
    aborted: bool = False
    avoid: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)

    def attempt_failed(self, exc: InstanceFailure, max_attempts: int) -> None:
        """Remember a failed attempt (before the first token).

        Raises:
            RequestError: UNAVAILABLE naming every failure, when it was attempt ``max_attempts``.
        """
        self.failures.append(f"attempt {len(self.failures) + 1}: {exc.message}")
        self.avoid.add(exc.instance)
        if len(self.failures) >= max_attempts:
            raise RequestError(
                "UNAVAILABLE", f"request {self.request_id} failed on {len(self.failures)} "
                f"attempt(s) (router.max_attempts={max_attempts}): {'; '.join(self.failures)}: "
                "retry later; `orch status` shows the instances")


def event_error(request_id: str, event: TokenEvent) -> RequestError:
    """The error an ``error`` event ends its request with: :class:`InstanceFailure` when the
    instance failed (``retryable``), UNAVAILABLE when the router ended it, else INTERNAL (the
    worker's error for this request: never run again)."""
    where = f" on {event.instance}" if event.instance else ""
    message = f"request {request_id} failed{where}: {event.error}"
    if event.retryable:
        return InstanceFailure(event.instance, message)
    return RequestError("UNAVAILABLE" if event.source == "router" else "INTERNAL", message)


class Attempt:
    """One placement of a request: its pump queue, its route, and the leader calls that run
    beside its stream (launch, first-token handover, abort). A failed side call reaches the
    stream as a retryable error event, so a hung call never holds up a failover.

    Args:
        flow, pump: the router's.
        spec: the request under this attempt's id.
        spawn: runs a coroutine as a tracked background task (the router's).
    """

    def __init__(self, flow: Flow, pump: EventPump, spec: RequestSpec,
                 spawn: Callable[[Coroutine], asyncio.Task]) -> None:
        self.flow, self.pump, self.spec, self._spawn = flow, pump, spec, spawn
        self.queue = pump.register(spec.request_id)
        self.route: Route | None = None

    def placed(self, route: Route) -> None:
        """The attempt holds ``route``: events of its instances reach the queue from now on."""
        self.route = route
        self.pump.watch(self.spec.request_id, route.instances)

    def launch(self) -> None:
        """Start computing (flow.launch in the background)."""
        self._spawn(self._side_call(self.flow.launch(self.spec, self.route)))

    def first_token(self, token_id: int, finished: bool) -> asyncio.Task:
        """The first token is out: from now on the request depends on its main (decode)
        instance only; hands the token over (flow.on_first_token) in the background."""
        self.pump.watch(self.spec.request_id, {self.route.main})
        return self._spawn(self._side_call(
            self.flow.on_first_token(self.route, token_id, finished)))

    def end(self) -> None:
        """Every exit: stop routing its events; a route the workers did not end themselves is
        aborted on its instances before its load is given back."""
        self.pump.unregister(self.spec.request_id)
        if self.route is not None and self.route.workers_done:
            self.flow.release(self.route)
        elif self.route is not None:
            self._spawn(self._abort_then_release(self.route))

    async def _side_call(self, call: Coroutine) -> None:
        try:
            await call
        except InstanceFailure as exc:
            self.pump.deliver(TokenEvent(self.spec.request_id, finish_reason="error",
                                         error=exc.message, source="router",
                                         instance=exc.instance, retryable=True))

    async def _abort_then_release(self, route: Route) -> None:
        # NOTE: the load (and the admission queue's wake-up) waits for the blocks to be free.
        try:
            await self.flow.abort(route)
        finally:
            self.flow.release(route)

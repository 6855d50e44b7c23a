"""The router: validate, tokenize, place through the flow, stream tokens back, account.

One request, linearly (see DESIGN.md "One request"): accept (validate + tokenize + id + seed)
-> ``flow.place`` -> ``flow.launch`` -> events from the pump until a finish -> stats. Any
exit before the finish (client cancel, timeout, leader failure) aborts the request on every
instance it touched. gRPC lives in server.py; this module speaks dataclasses only.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator, Protocol

from engine.sampling_params import fill_seed
from prefill_worker.messages import InstanceStatusInfo, RequestSpec, TokenEvent
from orchestrator.checkpoint import ModelInfo
from orchestrator.detokenizer import IncrementalDetokenizer, Tokenizer
from orchestrator.flow import Flow, Route
from orchestrator.leader import EventPump, LeaderError
from orchestrator.request import GenerateInput, OutputChunk, RequestError
from orchestrator.stream import StreamProgress
from orchestrator.validate import validate_request

log = logging.getLogger(__name__)
# Seconds the aborted leftovers of a drain get to end before the router stops anyway.
SHUTDOWN_ABORT_S = 10.0


class RouterMetrics(Protocol):
    """What the router reports; ``orchestrator.metrics.RouterMetrics`` implements it."""

    def request_finished(self, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None: ...

    def request_rejected(self, code: str) -> None: ...

    def update_instances(self, statuses: list[InstanceStatusInfo]) -> None: ...


class NoMetrics:
    """The default: report nothing."""

    def request_finished(self, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        pass

    def request_rejected(self, code: str) -> None:
        pass

    def update_instances(self, statuses: list[InstanceStatusInfo]) -> None:
        pass


class Router:
    """Serves requests over a :class:`Flow`; all methods run on one asyncio loop.

    Args:
        flow: DisaggregatedFlow or ColocatedFlow over the instance leaders.
        model: vocab / EOS / max_model_len of the served model.
        tokenizer: for text prompts and streamed text (None: token ids only, no text).
        request_timeout_s: bound of every wait of one request (reservation queue, next event).
        metrics: a :class:`RouterMetrics` (default: none).
    """

    def __init__(self, flow: Flow, model: ModelInfo, tokenizer: Tokenizer | None,
                 request_timeout_s: float, metrics: RouterMetrics | None = None,
                 poll_timeout_s: float = 0.5) -> None:
        self.flow, self.model, self.tokenizer = flow, model, tokenizer
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics or NoMetrics()
        self.pump = EventPump(flow.leaders, poll_timeout_s=poll_timeout_s)
        self._routes: dict[str, Route | None] = {}  # in-flight request id -> route
        self._background: set[asyncio.Task] = set()
        self._accepting = True
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    def start(self) -> None:
        """Start polling the leaders (call from the running loop)."""
        self.pump.start()

    async def stop(self, drain_timeout_s: float) -> None:
        """Refuse new requests, wait (bounded) for in-flight ones, then stop polling."""
        self._accepting = False
        # NOTE: requests still waiting for KV blocks have nothing computed: end them now.
        self.flow.close_waiting(RequestError(
            "UNAVAILABLE", "the router is shutting down before this request got KV blocks: "
                           "retry on another router or after it restarts"))
        try:
            await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
        except asyncio.TimeoutError:
            log.warning("%d request(s) still running after %.1f s drain: ending them",
                        self.in_flight, drain_timeout_s)
            for request_id in list(self._routes):
                self.pump.deliver(TokenEvent(
                    request_id, finish_reason="error", source="router",
                    error=f"the router shut down before the request finished (drain limit "
                          f"{drain_timeout_s:g} s): retry it"))
            try:
                await asyncio.wait_for(self._idle.wait(), SHUTDOWN_ABORT_S)
            except asyncio.TimeoutError:
                log.warning("%d request(s) did not end after the drain", self.in_flight)
        await self.pump.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=drain_timeout_s)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        """Run one request; yields chunks, the last with finish_reason and stats.

        Raises:
            RequestError: bad input (INVALID_ARGUMENT), no capacity (RESOURCE_EXHAUSTED),
                a stuck request (DEADLINE_EXCEEDED), a failed instance (UNAVAILABLE /
                INTERNAL), or shutting down (UNAVAILABLE).
        """
        try:
            spec = await self._accept(inp)
        except RequestError as exc:
            self.metrics.request_rejected(exc.code)
            raise
        progress = StreamProgress(spec, self.model, time.monotonic())
        queue = self.pump.register(spec.request_id)
        self._routes[spec.request_id] = None
        self._idle.clear()
        try:
            route = await self._place(spec, progress)
            self._routes[spec.request_id] = route
            self.pump.watch(spec.request_id, route.instances)
            await self.flow.launch(spec, route)
            async for chunk in self._stream(spec, route, queue, progress):
                yield chunk
        except RequestError as exc:
            self._record(progress, outcome=exc.code)
            raise
        finally:
            self._end(spec.request_id, progress)

    async def _place(self, spec: RequestSpec, progress: StreamProgress) -> Route:
        """flow.place; a failure here is a rejection (nothing was computed)."""
        try:
            return await self.flow.place(spec, progress.start + self.request_timeout_s)
        except RequestError as exc:
            progress.recorded = True
            self.metrics.request_rejected(exc.code)
            raise

    async def _stream(self, spec: RequestSpec, route: Route, queue: asyncio.Queue,
                      progress: StreamProgress) -> AsyncIterator[OutputChunk]:
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        while True:
            event = await self._next_event(queue, route)
            tokens = progress.add(event, time.monotonic())
            finish = progress.finish_reason(event)
            admit = None
            if progress.first_event_now:  # NOTE: runs while the first token goes out
                admit = self._spawn(
                    self.flow.on_first_token(route, tokens[0], finished=finish is not None))
            text = detok.add(tokens) if detok else ""
            if finish and detok:
                text += detok.flush()
            if finish:
                if admit:
                    await admit
                progress.done = True
                if event.finish_reason is None:
                    # NOTE: the router stopped it (EOS / max_tokens the leader did not report):
                    # stop it on the workers too so its KV is freed.
                    self._spawn(self.flow.abort(route))
                self._record(progress, outcome=finish)
                yield OutputChunk(spec.request_id, tokens, text, finish,
                                  progress.stats(route, time.monotonic()))
                return
            yield OutputChunk(spec.request_id, tokens, text)
            if admit:
                await admit

    async def _next_event(self, queue: asyncio.Queue, route: Route) -> TokenEvent:
        try:
            event = await asyncio.wait_for(queue.get(), self.request_timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(
                "DEADLINE_EXCEEDED",
                f"request {route.request_id}: no tokens from {sorted(route.instances)} within "
                f"router.request_timeout_s={self.request_timeout_s:g} s: the instance may be "
                "overloaded or stuck; check `orch status` and the worker logs, or raise "
                "router.request_timeout_s") from None
        if event.finish_reason == "error":
            code = "UNAVAILABLE" if event.source == "router" else "INTERNAL"
            where = f" on {event.instance}" if event.instance else ""
            raise RequestError(code, f"request {route.request_id} failed{where}: {event.error}")
        return event

    async def _accept(self, inp: GenerateInput) -> RequestSpec:
        if not self._accepting:
            raise RequestError("UNAVAILABLE", "the router is shutting down: retry on another "
                                              "router or after it restarts")
        request_id = inp.request_id or uuid.uuid4().hex
        self._check_new(request_id)
        # NOTE: tokenizing a long prompt takes seconds; off the event loop, other streams go on.
        ids = await asyncio.to_thread(validate_request, inp, self.model, self.tokenizer)
        self._check_new(request_id)  # another request may have taken the id meanwhile
        return RequestSpec(request_id=request_id, prompt_token_ids=ids,
                           sampling=fill_seed(inp.sampling), arrival_time=time.time())

    def _check_new(self, request_id: str) -> None:
        if request_id in self._routes:
            raise RequestError("INVALID_ARGUMENT",
                               f"request id {request_id!r} is already in flight: use a unique "
                               "request_id or leave it empty for a generated one")

    def _end(self, request_id: str, progress: StreamProgress) -> None:
        """Every exit path: abort what is still running, return load, forget the request."""
        route = self._routes.pop(request_id, None)
        self.pump.unregister(request_id)
        if not progress.done:
            self._record(progress, outcome="cancelled")  # no-op when already recorded
        if route is not None:
            if not progress.done:
                self._spawn(self.flow.abort(route))
            self.flow.release(route)
        if not self._routes:
            self._idle.set()

    def _record(self, progress: StreamProgress, outcome: str) -> None:
        if progress.recorded:
            return
        progress.recorded = True
        now = time.monotonic()
        self.metrics.request_finished(outcome, progress.ttft(), progress.tpot(),
                                      now - progress.start, progress.spec.num_prompt_tokens,
                                      progress.completion_tokens)

    def _spawn(self, coro) -> asyncio.Task:
        """A tracked background task (awaited by :meth:`stop`); its failure is logged."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(_forget(self._background))
        return task

    async def abort(self, request_id: str) -> bool:
        """Abort an in-flight request; its stream ends with finish_reason "abort"."""
        route = self._routes.get(request_id)
        if route is None:  # unknown, or still waiting for a reservation
            return request_id in self._routes and self.flow.cancel_waiting(
                request_id, RequestError("CANCELLED", f"request {request_id} was aborted while "
                                                      "it waited for decode KV blocks"))
        await self.flow.abort(route)
        return self.pump.deliver(TokenEvent(request_id, finish_reason="abort",
                                            source="router", instance=route.main))

    async def status(self) -> list[InstanceStatusInfo]:
        """Every leader's ``status()`` (bounded); unreachable ones are named, not hidden."""
        async def one(leader) -> InstanceStatusInfo:
            try:
                return await leader.call("status")
            except LeaderError as exc:
                return InstanceStatusInfo(name=f"{leader.name} (unreachable: {exc})",
                                          role=leader.role, tp=0)
        statuses = list(await asyncio.gather(*(one(l) for l in self.flow.leaders)))
        self.metrics.update_instances(statuses)
        return statuses

    async def report_instances(self, period_s: float = 1.0) -> None:
        """Forever: push instance status to the metrics every ``period_s`` seconds."""
        while True:
            await self.status()
            await asyncio.sleep(period_s)


def _forget(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %s", task.exception())
    return done

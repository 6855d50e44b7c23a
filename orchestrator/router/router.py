"""The router: validate, tokenize, place through the flow, stream tokens back, account.

One request, linearly (see DESIGN.md "One request"): accept (validate + tokenize + id + seed)
-> attempts: ``flow.place`` -> ``flow.launch`` -> events from the pump until a finish ->
stats. Each attempt has its own router-unique id ("<request_id>@<n>"): the workers and the
pump never see the client's id, so a reused id or a failed attempt's late events cannot reach
another attempt. An instance failure before the first token places the request again
(``max_attempts``); after it the request ends UNAVAILABLE. Any exit before the finish
(client cancel, abort, timeout, failure) aborts the attempt on every instance it touched.
gRPC lives in server.py; this module speaks dataclasses only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Protocol

from engine.sampling_params import fill_seed
from rank.messages import InstanceStatusInfo, TokenEvent
from engine.request import RequestSpec
from orchestrator.router.attempt import Attempt, InFlight, event_error
from orchestrator.config.checkpoint import ModelInfo
from orchestrator.router.detokenizer import IncrementalDetokenizer, Tokenizer
from orchestrator.router.flow import Flow, Route
from orchestrator.router.leader import EventPump
from orchestrator.router.request import GenerateInput, InstanceFailure, OutputChunk, RequestError
from orchestrator.router.stream import StreamProgress
from orchestrator.router.validate import validate_request

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
        poll_timeout_s: how long one leader poll may block (seconds).
        max_attempts: most placements of one request (`router.max_attempts`).
    """

    def __init__(self, flow: Flow, model: ModelInfo, tokenizer: Tokenizer | None,
                 request_timeout_s: float, metrics: RouterMetrics | None = None,
                 poll_timeout_s: float = 0.5, max_attempts: int = 3) -> None:
        self.flow, self.model, self.tokenizer = flow, model, tokenizer
        self.request_timeout_s, self.max_attempts = request_timeout_s, max_attempts
        self.metrics = metrics or NoMetrics()
        self.pump = EventPump(flow.leaders, poll_timeout_s=poll_timeout_s)
        self._requests: dict[str, InFlight] = {}  # client request id -> its state
        self._attempt_numbers = itertools.count(1)
        self._background: set[asyncio.Task] = set()
        self._accepting = True
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._requests)

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
            for state in list(self._requests.values()):
                self.pump.deliver(TokenEvent(
                    state.attempt_id, finish_reason="error", source="router",
                    error=f"the router shut down before the request finished (drain limit "
                          f"{drain_timeout_s:g} s): retry it"))
            try:
                await asyncio.wait_for(self._idle.wait(), SHUTDOWN_ABORT_S)
            except asyncio.TimeoutError:
                log.warning("%d request(s) did not end after the drain", self.in_flight)
        await self.pump.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=drain_timeout_s)

    def instance_failed(self, name: str, reason: str) -> None:
        """``name`` is dead or hung (the health monitor says so; call on the router loop):
        every request watching it reacts now, without waiting for a poll to fail, and every
        call in flight to it fails now (a reserve on it tries the next decode). Before its
        first token a request is placed again elsewhere; after it, it ends UNAVAILABLE.

        Raises:
            KeyError: ``name`` is no instance of this router.
        """
        self.flow.leader(name).abandon_calls(f"{name} failed: {reason}")
        told = self.pump.fail_instance(name, f"{name} failed: {reason}")
        log.info("%s failed (%s): %d request(s) still waiting on it were told", name, reason,
                 told)

    async def generate(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        """Run one request; yields chunks, the last with finish_reason and stats.

        Raises:
            RequestError: bad input (INVALID_ARGUMENT), no capacity (RESOURCE_EXHAUSTED),
                a stuck request (DEADLINE_EXCEEDED), failed instances on every attempt or
                after the first token (UNAVAILABLE), a worker's error for this request
                (INTERNAL), or shutting down (UNAVAILABLE).
        """
        try:
            state = self._open(inp.request_id or uuid.uuid4().hex)
            spec = await self._accept(inp, state)
        except RequestError as exc:
            self.metrics.request_rejected(exc.code)
            raise
        progress = StreamProgress(spec, self.model, time.monotonic())
        try:
            async for chunk in self._serve(state, spec, progress):
                yield chunk
        except RequestError as exc:
            self._record(progress, outcome=exc.code)
            raise
        finally:
            self._close(state, progress)

    async def _serve(self, state: InFlight, spec: RequestSpec,
                     progress: StreamProgress) -> AsyncIterator[OutputChunk]:
        """Attempts until one streams to its finish, the request is aborted, or the
        attempts run out (UNAVAILABLE naming every failure)."""
        while not state.aborted:
            try:
                async for chunk in self._attempt(state, spec, progress):
                    yield chunk
                if progress.done:
                    return
            except InstanceFailure as exc:
                if progress.completion_tokens:
                    raise RequestError("UNAVAILABLE", f"{exc.message}; {progress.completion_tokens}"
                                       " token(s) were already streamed, so it is not run "
                                       "again: retry the request") from None
                state.attempt_failed(exc, self.max_attempts)
                log.debug("request %s: %s; placing it again", state.request_id, exc.message)
        progress.done = True
        self._record(progress, outcome="abort")
        yield OutputChunk(state.request_id, finish_reason="abort",
                          stats=progress.stats(state.route, time.monotonic()))

    async def _attempt(self, state: InFlight, spec: RequestSpec,
                       progress: StreamProgress) -> AsyncIterator[OutputChunk]:
        """One placement under a fresh attempt id: place -> launch -> stream. Returns without
        a chunk when aborted while placing.

        Raises:
            InstanceFailure: an instance it depends on failed (the caller may place again).
        """
        attempt = Attempt(self.flow, self.pump, replace(
            spec, request_id=f"{state.request_id}@{next(self._attempt_numbers)}"), self._spawn)
        state.attempt_id = attempt.spec.request_id
        try:
            route = await self._place(state, attempt.spec, progress)
            if route is None:
                return
            state.route = route
            attempt.placed(route)
            if not state.aborted:  # else its abort event is already queued
                attempt.launch()
            async for chunk in self._stream(state, attempt, progress):
                yield chunk
        finally:
            attempt.end()

    async def _place(self, state: InFlight, spec: RequestSpec,
                     progress: StreamProgress) -> Route | None:
        """flow.place; None when aborted meanwhile. A failure before any attempt failed is a
        rejection (nothing was computed)."""
        try:
            return await self.flow.place(spec, progress.start + self.request_timeout_s,
                                         state.avoid)
        except RequestError as exc:
            if state.aborted:
                return None
            if not state.failures:
                progress.recorded = True
                self.metrics.request_rejected(exc.code)
            raise

    async def _stream(self, state: InFlight, attempt: Attempt,
                      progress: StreamProgress) -> AsyncIterator[OutputChunk]:
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None
        route = attempt.route
        while True:
            event = await self._next_event(state, attempt, progress)
            tokens = progress.add(event, time.monotonic())
            finish = progress.finish_reason(event)
            handover = None
            if progress.first_event_now:  # NOTE: runs while the first token goes out
                handover = attempt.first_token(tokens[0], finished=finish is not None)
            text = detok.add(tokens) if detok else ""
            if finish and detok:
                text += detok.flush()
            if finish:
                if handover:  # NOTE: frees the reservation before the load is given back
                    await handover
                # NOTE: a finish the router made (EOS / max_tokens the leader did not report,
                # an abort) leaves the request running on the workers: the attempt aborts it.
                route.workers_done = (event.source != "router"
                                      and event.finish_reason in ("stop", "length"))
                progress.done = True
                self._record(progress, outcome=finish)
                yield OutputChunk(state.request_id, tokens, text, finish,
                                  progress.stats(route, time.monotonic()))
                return
            yield OutputChunk(state.request_id, tokens, text)

    async def _next_event(self, state: InFlight, attempt: Attempt,
                          progress: StreamProgress) -> TokenEvent:
        """The attempt's next event; raises an error event as its RequestError."""
        route = attempt.route
        while True:
            try:
                event = await asyncio.wait_for(attempt.queue.get(), self.request_timeout_s)
            except asyncio.TimeoutError:
                raise RequestError(
                    "DEADLINE_EXCEEDED",
                    f"request {state.request_id}: no tokens from {sorted(route.instances)} "
                    f"within router.request_timeout_s={self.request_timeout_s:g} s: the "
                    "instance may be overloaded or stuck; check `orch status` and the worker "
                    "logs, or raise router.request_timeout_s") from None
            if progress.completion_tokens and event.instance not in ("", route.main):
                continue  # NOTE: prefill's failure, queued before the first token moved on
            if event.finish_reason != "error":
                return event
            raise event_error(state.request_id, event)

    def _open(self, request_id: str) -> InFlight:
        """Know the request from now on (an Abort finds it even while it is tokenized)."""
        if not self._accepting:
            raise RequestError("UNAVAILABLE", "the router is shutting down: retry on another "
                                              "router or after it restarts")
        if request_id in self._requests:
            raise RequestError("INVALID_ARGUMENT",
                               f"request id {request_id!r} is already in flight: use a unique "
                               "request_id or leave it empty for a generated one")
        state = self._requests[request_id] = InFlight(request_id)
        self._idle.clear()
        return state

    async def _accept(self, inp: GenerateInput, state: InFlight) -> RequestSpec:
        """Validate + tokenize (off the loop: a long prompt takes seconds) + seed."""
        try:
            ids = await asyncio.to_thread(validate_request, inp, self.model, self.tokenizer)
        except BaseException:
            self._close(state, None)
            raise
        return RequestSpec(request_id=state.request_id, prompt_token_ids=ids,
                           sampling=fill_seed(inp.sampling), arrival_time=time.time())

    def _close(self, state: InFlight, progress: StreamProgress | None) -> None:
        """Every exit path: forget the request (its attempt already cleaned up after itself)."""
        self._requests.pop(state.request_id, None)
        if progress is not None and not progress.done:
            self._record(progress, outcome="cancelled")  # no-op when already recorded
        if not self._requests:
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
        """Abort a request the router knows, at whatever step it is (tokenizing, waiting
        for blocks, reserving, launching, streaming): each later step checks the mark, the
        stream ends with finish_reason "abort" and the attempt is aborted on every instance
        it touched. False for an unknown or ended id."""
        state = self._requests.get(request_id)
        if state is None:
            return False
        state.aborted = True
        if state.attempt_id:
            self.flow.cancel_waiting(state.attempt_id, RequestError(
                "CANCELLED", f"request {request_id} was aborted"))
            self.pump.deliver(TokenEvent(state.attempt_id, finish_reason="abort",
                                         source="router"))
        return True


def _forget(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background task failed: %s", task.exception())
    return done

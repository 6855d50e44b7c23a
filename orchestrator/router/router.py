"""The router: one client request's life, read top to bottom in :meth:`Router.generate`.

accept (validate + tokenize + seed) -> attempts { place -> launch -> stream to a finish } ->
end, the request's phase and counters in one :class:`RequestState`. Each attempt has its own
router-unique id "<request_id>@<n>": workers and the pump never see the client's id, so a
reused id or a failed attempt's late events cannot reach another attempt. Failures are
exceptions (a failed leader call beside the stream, a failed instance, a worker's error): an
instance failure before the first token places the request again (``max_attempts``), after
it the request migrates: prompt + streamed tokens placed again, the stream goes on
(``max_migrations``). An attempt the workers did not end themselves is aborted on
every instance it touched. gRPC lives in api/server.py; this module speaks dataclasses only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator, Awaitable

from engine.request import RequestSpec
from engine.sampling_params import fill_seed
from orchestrator.config.checkpoint import ModelInfo
from orchestrator.router.availability import Availability, HealthView
from engine.grammar import GrammarCompiler
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.router.fleet import Fleet
from orchestrator.router.flow import Flow, Route
from orchestrator.router.event_pump import EventPump
from orchestrator.router.leader import LeaderClient, cancel_task
from orchestrator.router.metrics_sink import NoMetrics, RouterMetrics
from orchestrator.router.reports import InstanceReports
from orchestrator.router.output_text import OutputText
from orchestrator.router.policies import Policy
from orchestrator.router.request import GenerateInput, InstanceFailure, OutputChunk, RequestError
from orchestrator.router.request_state import Phase, RequestState
from orchestrator.router.validate import validate_request
from rank.messages import TokenEvent

log = logging.getLogger(__name__)
# Seconds the aborted leftovers of a drain get to end before the router stops anyway.
SHUTDOWN_ABORT_S = 10.0


class Router:
    """Serves requests over a :class:`Flow`; all methods run on one asyncio loop.

    Args:
        flow: DisaggregatedFlow or ColocatedFlow over the instance leaders.
        model: vocab / EOS / max_model_len of the served model.
        tokenizer: for text prompts and streamed text (None: token ids only, no text).
        request_timeout_s: bound of every wait of one request (reservation queue, next event).
        metrics: a :class:`RouterMetrics` (default: none).
        max_attempts: most placements of one request that ran on an instance
            (`router.max_attempts`).
        max_migrations: most moves of one request after tokens streamed
            (`router.max_migrations`).
        health: the health monitor: a placement waits while every instance of a role is
            being restarted (None: it never waits; see :class:`Availability`).
        replica: this router's index among ``router.replicas`` (attempt ids stay unique
            across replicas: replica k > 0 numbers its attempts "<request_id>@k.n").
        reports: where the leaders' own liveness and status reports go (their streams ask for
            them; orchestrator/router/reports.py); None: not asked for.
    """

    def __init__(self, flow: Flow, model: ModelInfo, tokenizer: Tokenizer | None,
                 request_timeout_s: float, metrics: RouterMetrics | None = None,
                 max_attempts: int = 3, health: HealthView | None = None,
                 max_migrations: int = 3, replica: int = 0,
                 reports: InstanceReports | None = None) -> None:
        self.flow, self.model, self.tokenizer = flow, model, tokenizer
        # NOTE: grammars are checked here, before a request is accepted (a bad one is a 400)
        self.grammars = GrammarCompiler(tokenizer.file, model.vocab_size,
                                        model.eos_token_ids) if tokenizer else None
        self.request_timeout_s, self.max_attempts = request_timeout_s, max_attempts
        self.max_migrations = max_migrations
        self.metrics = metrics or NoMetrics()
        self.availability = Availability(health)
        self.pump = EventPump(flow.leaders, on_capacity=flow.capacity, kv_index=flow.kv_index,
                              reports=reports)
        self._requests: dict[str, RequestState] = {}  # client request id -> its state
        self.fleet = Fleet(flow, self.pump, self.availability,
                           lambda: [req.instances for req in self._requests.values()],
                           SHUTDOWN_ABORT_S)
        if health is not None:
            health.add_listener(self.fleet.health_changed)
        numbers = itertools.count(1)
        self._attempt_numbers = (numbers if not replica
                                 else (f"{replica}.{n}" for n in numbers))
        self._background: set[asyncio.Task] = set()
        self._accepting = True
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def start(self) -> None:
        """Start following the leaders' event streams (call from the running loop)."""
        self.pump.start()

    async def stop(self, drain_timeout_s: float) -> None:
        """Refuse new requests, wait (bounded) for in-flight ones, then stop the event streams."""
        self._accepting = False
        # NOTE: requests still waiting for an instance or KV blocks have nothing computed:
        # end them now.
        self.availability.close(RequestError(
            "UNAVAILABLE", "the router is shutting down before an instance came back for "
                           "this request: retry on another router or after it restarts"))
        self.flow.close_waiting(RequestError(
            "UNAVAILABLE", "the router is shutting down before this request got KV blocks: "
                           "retry on another router or after it restarts"))
        if not await self._drained(drain_timeout_s):
            log.warning("%d request(s) still running after %.1f s drain: ending them",
                        self.in_flight, drain_timeout_s)
            for req in list(self._requests.values()):
                req.fail(RequestError(
                    "UNAVAILABLE", f"request {req.request_id} failed: the router shut down "
                    f"before the request finished (drain limit {drain_timeout_s:g} s): retry it"))
            if not await self._drained(SHUTDOWN_ABORT_S):
                log.warning("%d request(s) did not end after the drain", self.in_flight)
        await self.pump.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=drain_timeout_s)
        await asyncio.gather(*(leader.close() for leader in self.flow.leaders))

    async def abort(self, request_id: str) -> bool:
        """Abort a request the router knows, at whatever step it is (tokenizing, waiting
        for blocks, reserving, launching, streaming): each later step checks the mark, the
        stream ends with finish_reason "abort" and the attempt is aborted on every instance
        it touched. False for an unknown or ended id."""
        req = self._requests.get(request_id)
        if req is None or req.ended:
            return False
        req.abort()
        if req.attempt_id:
            self.flow.cancel_waiting(req.attempt_id, RequestError(
                "CANCELLED", f"request {request_id} was aborted"))
        return True

    async def generate(self, inp: GenerateInput) -> AsyncIterator[OutputChunk]:
        """Run one request; yields chunks, the last with finish_reason and stats.

        Raises:
            RequestError: bad input (INVALID_ARGUMENT), no capacity (RESOURCE_EXHAUSTED),
                a stuck request (DEADLINE_EXCEEDED), failed instances on every attempt or
                on every migration (UNAVAILABLE), a worker's error for this request
                (INTERNAL), or shutting down (UNAVAILABLE).
        """
        req = self._open(inp.request_id or uuid.uuid4().hex)
        try:
            await self._accept(req, inp)
            # NOTE: one text stream for every attempt: a migrated stream's text goes on
            out = OutputText(self.tokenizer, inp.stop)
            while not req.ended:
                if req.aborted:
                    yield self._last_chunk(req, (), "", "abort")
                    return
                try:
                    async with aclosing(self._attempt(req, out)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                except InstanceFailure as exc:
                    self._attempt_failed(req, exc)
        except RequestError as exc:
            self._end(req, Phase.FAILED, exc.code)
            raise
        finally:
            self._close(req)

    async def _attempt(self, req: RequestState, out: OutputText
                       ) -> AsyncIterator[OutputChunk]:
        """One placement under a fresh attempt id: place -> launch -> stream to the finish
        (its chunk ends the request). Returns without a chunk when aborted before launch.

        Raises:
            InstanceFailure: an instance it depends on failed (the caller may place again).
            RequestError: as :meth:`generate`.
        """
        spec = req.new_attempt(next(self._attempt_numbers))
        # NOTE: registered before placing: an eager PD launch computes while decode reserves
        inbox = self.pump.register(req.attempt_id, req.request_id, set())
        try:
            route = await self._place(req, spec)
        except BaseException:
            self.pump.unregister(req.attempt_id)
            raise
        if route is None:
            self.pump.unregister(req.attempt_id)
            return
        req.placed(route)
        self.pump.widen(req.attempt_id, route.instances)
        by_workers = False  # the workers ended it themselves: nothing left to abort
        try:
            if req.aborted:  # NOTE: placed after the abort came: never launched, freed below
                return
            req.calls["launch"] = self._spawn(self.flow.launch(spec, route))
            while not req.ended:
                event = await req.next_event(inbox, self.request_timeout_s)
                chunk, by_workers = await self._on_event(req, event, out,
                                                         inbox.first_token_at)
                yield chunk
        finally:
            self.pump.unregister(req.attempt_id)
            self._release(route, abort=not by_workers, handover=req.calls.pop("handover", None))

    def _attempt_failed(self, req: RequestState, exc: InstanceFailure) -> None:
        """Remember the failure, the caller places again: before the first token of the
        attempt as a retry, after it as a migration (prompt + streamed tokens).

        Raises:
            RequestError: UNAVAILABLE past ``max_attempts`` or ``max_migrations``.
        """
        if req.phase is Phase.DECODING:
            req.migrate(exc, self.max_migrations, time.monotonic())
            self.metrics.request_migrated()
            log.info("request %s: %s; migrating it with %d streamed token(s) (migration %d)",
                     req.request_id, exc.message, req.completion_tokens, req.migrations)
            return
        req.attempt_failed(exc, self.max_attempts)
        log.debug("request %s: %s; placing it again", req.request_id, exc.message)

    async def _place(self, req: RequestState, spec: RequestSpec) -> Route | None:
        """flow.place within the request's deadline, once every role has a healthy
        instance (while all of a role's are being restarted it waits: no attempt is spent;
        also inside the placement, e.g. a prefill that died while the request waited for
        decode room); None when aborted meanwhile. A migration's placement error also names
        the failures that made it move."""
        deadline = req.placing_since + self.request_timeout_s

        def ready(pools: dict[str, Policy]) -> Awaitable[None]:
            return self.availability.wait(pools, deadline, req.woken, req.avoid)
        try:
            await ready(self.flow.pools)
            if req.aborted:
                return None
            return await self.flow.place(
                spec, deadline, req.avoid,
                watch=lambda names: self.pump.widen(req.attempt_id, names), ready=ready)
        except RequestError as exc:
            if req.aborted:
                return None
            if req.migrations:  # NOTE: the client saw tokens: say why it was moving
                raise RequestError(exc.code, f"{exc.message}; it was being migrated after "
                                   f"{req.completion_tokens} streamed token(s): "
                                   f"{'; '.join(req.failures)}") from None
            raise

    async def _on_event(self, req: RequestState, event: TokenEvent | None, out: OutputText,
                        arrived: float | None) -> tuple[OutputChunk, bool]:
        """The chunk ``event`` makes (None: aborted: the last chunk, "abort"; a stop string
        found: the last chunk, "stop", its text cut before it), and whether the workers
        ended the request themselves (nothing left to abort on them). ``arrived``: when the
        attempt's first token event reached the router (monotonic)."""
        tokens, finish = req.take(event, time.monotonic()) if event else ((), "abort")
        text, stopped, taken = out.add_until_stop(tokens)
        if taken < len(tokens):  # NOTE: a stop string inside a multi-token event
            req.untake(len(tokens) - taken)
            tokens, finish = tokens[:taken], "stop"
        if finish is not None and not stopped:
            rest, stopped = out.finish()
            text += rest
        if stopped and finish != "abort":
            finish = "stop"
        if tokens and req.phase is Phase.PREFILLING:
            now = time.monotonic()
            self.metrics.first_token(req.first_token_phases(event, arrived or now, now))
            self._first_token(req, tokens[0], finished=finish is not None)
        logprobs = event.logprobs[:len(tokens)] if event else ()
        if finish is None:
            return OutputChunk(req.request_id, tokens, text, logprobs=logprobs), False
        handover = req.calls.pop("handover", None)
        if handover is not None:  # NOTE: frees the reservation before the load is given back
            await asyncio.wait({handover})
        # NOTE: a finish the router made (EOS / max_tokens the leader did not report, an
        # abort) leaves the request running on the workers: the attempt aborts it.
        by_workers = event is not None and event.finish_reason in ("stop", "length")
        return self._last_chunk(req, tokens, text, finish, logprobs), by_workers

    def _first_token(self, req: RequestState, token_id: int, finished: bool) -> None:
        """DECODING: from now on the request depends on its main instance only; the token
        is handed over (flow.on_first_token) beside the stream. A late reservation
        (``router.reserve_after_first_token``) names the main instance only in the handover:
        the attempt watches the prefill until then, and only the decode once it is done."""
        req.decoding()
        self.pump.watch(req.attempt_id, req.instances)
        handover = req.calls["handover"] = self._spawn(
            self.flow.on_first_token(req.route, token_id, finished))
        attempt = req.attempt_id

        def narrow(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is None \
                    and req.attempt_id == attempt and not req.ended:
                self.pump.watch(attempt, req.instances)
        handover.add_done_callback(narrow)

    def _last_chunk(self, req: RequestState, tokens: tuple[int, ...], text: str,
                    finish: str, logprobs: tuple = ()) -> OutputChunk:
        """End the request with ``finish`` ("stop" / "length": FINISHED, "abort": ABORTED)
        and make its last chunk, with the stats."""
        self._end(req, Phase.FINISHED if finish in ("stop", "length") else Phase.ABORTED,
                  finish)
        return OutputChunk(req.request_id, tokens, text, finish, req.stats(time.monotonic()),
                           logprobs)

    def _open(self, request_id: str) -> RequestState:
        """Know the request from now on (an Abort finds it even while it is tokenized).

        Raises:
            RequestError: shutting down (UNAVAILABLE) or the id is in flight
                (INVALID_ARGUMENT); reported as a rejection.
        """
        refusal = None
        if not self._accepting:
            refusal = RequestError("UNAVAILABLE", "the router is shutting down: retry on "
                                                  "another router or after it restarts")
        elif request_id in self._requests:
            refusal = RequestError(
                "INVALID_ARGUMENT", f"request id {request_id!r} is already in flight: use a "
                "unique request_id or leave it empty for a generated one")
        if refusal is not None:
            self.metrics.request_rejected(refusal.code)
            raise refusal
        now = time.monotonic()
        req = self._requests[request_id] = RequestState(request_id, now, opened_at=now)
        self._idle.clear()
        return req

    async def _accept(self, req: RequestState, inp: GenerateInput) -> None:
        """Validate + tokenize + seed; off the loop (a long prompt takes seconds, a grammar
        compiles, a tokenizer may stall: the loop must still take aborts) unless the prompt is
        token ids without a grammar: a thread hop costs more than checking those on a busy
        machine (the first token waits for it)."""
        args = (validate_request, inp, self.model, self.tokenizer, self.grammars)
        if inp.sampling.grammar is None and not inp.text:
            ids = args[0](*args[1:])
        else:
            ids = await asyncio.to_thread(*args)
        req.accepted(RequestSpec(request_id=req.request_id, prompt_token_ids=ids,
                                 sampling=fill_seed(inp.sampling), arrival_time=time.time()),
                     self.model.eos_token_ids, time.monotonic())

    def _close(self, req: RequestState) -> None:
        """Every exit: a request nothing ended was cancelled (the client went away); forget
        it (its attempt already cleaned up after itself)."""
        if not req.ended:
            self._end(req, Phase.ABORTED, "cancelled")
        del self._requests[req.request_id]
        if not self._requests:
            self._idle.set()

    def _end(self, req: RequestState, phase: Phase, outcome: str) -> None:
        """Move ``req`` to its end ``phase`` and report it to the metrics, exactly once."""
        if req.end(phase):
            self.metrics.request_rejected(outcome)
            return
        prompt_tokens = req.spec.num_prompt_tokens if req.spec else 0
        self.metrics.request_finished(outcome, req.ttft(), req.tpot(),
                                      time.monotonic() - req.start, prompt_tokens,
                                      req.completion_tokens)

    def _release(self, route: Route, abort: bool, handover: asyncio.Task | None) -> None:
        """The attempt ended: give back its load; with ``abort``, only after the request is
        aborted on its instances (prefill, then decode: the flow's order), and after its
        first token's ``handover``, if one still runs, was cancelled (a late reservation made
        by it would otherwise outlive the abort)."""
        if abort:
            self._spawn(self._abort_then_release(route, handover))
        else:
            self.flow.release(route)

    async def _abort_then_release(self, route: Route, handover: asyncio.Task | None) -> None:
        # NOTE: the load (and the admission queue's wake-up) waits for the blocks to be free.
        try:
            if handover is not None and not handover.done():
                await cancel_task(handover, SHUTDOWN_ABORT_S)
            await self.flow.abort(route)
        finally:
            self.flow.release(route)

    async def _drained(self, timeout_s: float) -> bool:
        """Whether every request ended within ``timeout_s`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def _spawn(self, coro) -> asyncio.Task:
        """A tracked background task (awaited by :meth:`stop`); its failure is logged."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(_forget(self._background))
        return task


def _forget(tasks: set[asyncio.Task]):
    def done(task: asyncio.Task) -> None:
        tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        # NOTE: a failed leader call beside a stream is that stream's to raise (debug here)
        level = logging.DEBUG if isinstance(task.exception(), RequestError) else logging.WARNING
        log.log(level, "background task failed: %s", task.exception())
    return done

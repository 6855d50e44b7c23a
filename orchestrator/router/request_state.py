"""One client request on the router: its :class:`Phase` and counters in one object.

``Router.generate`` owns one :class:`RequestState` per client request and drives it through
the phases; every transition goes through ``RequestState._move`` and the table ``_NEXT``, so
the legal life of a request is written once. Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field, replace

from engine.request import RequestSpec
from orchestrator.router.flow import Route
from orchestrator.router.event_pump import Inbox
from orchestrator.router.request import (InstanceFailure, RequestError, RequestStats,
                                         request_failed)
from rank.messages import TokenEvent


class Phase(enum.Enum):
    """Where a request is. The last three are ends: exactly one is reached, once."""

    ACCEPTED = "accepted"  # known (an Abort finds it): validating, tokenizing
    PLACING = "placing"  # an attempt id: reserving decode blocks, or waiting for them
    PREFILLING = "prefilling"  # placed on a route (launched unless aborted first), no token
    DECODING = "decoding"  # first token streamed: depends on its main instance only
    FINISHED = "finished"  # "stop" or "length"
    ABORTED = "aborted"  # Abort RPC, a worker's "abort", or the client went away
    FAILED = "failed"  # a RequestError ended it

    @property
    def ended(self) -> bool:
        return self in _ENDS


_ENDS = frozenset({Phase.FINISHED, Phase.ABORTED, Phase.FAILED})
_NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.ACCEPTED: _ENDS | {Phase.PLACING},
    Phase.PLACING: _ENDS | {Phase.PLACING, Phase.PREFILLING},  # PLACING: a failed attempt
    Phase.PREFILLING: _ENDS | {Phase.PLACING, Phase.DECODING},
    Phase.DECODING: _ENDS | {Phase.PLACING},  # PLACING: migration (prompt + streamed tokens)
}


@dataclass(eq=False)
class RequestState:
    """One client request from acceptance to its last message (router-owned, one loop).

    Attributes:
        request_id: the client's id (what every OutputChunk and Abort carry).
        start: when it was opened, then when it was accepted (validated and tokenized):
            TTFT, e2e and the placement deadline count from acceptance.
        phase: see :class:`Phase`; changed only by the methods below.
        spec: the accepted request (None while ACCEPTED).
        eos: token ids that end it (empty with ``ignore_eos``).
        completion_tokens: tokens streamed so far (never past max_tokens).
        cached_tokens: prompt tokens the instance that computed the prompt found in its prefix
            cache (from the first-token event).
        output_token_ids: those tokens (a migrated attempt's prompt ends with them).
        first_token_at, last_token_at: when the first / latest token came (None before).
        attempt_id: the current attempt's id "<request_id>@<n>" ("" before the first).
        route: the current attempt's route (None until placed).
        calls: the current attempt's leader calls running beside its stream, by name
            ("launch", "handover"); the stream's wait raises their failures.
        failures: one line per failed attempt or migration; avoid: the instances that
            failed it. retries / migrations: how many failed before / after tokens streamed.
        placing_since: when the current placement's deadline started (acceptance, or the
            last migration).
        opened_at, placed_at: when it was opened / its current attempt was placed.
        ttft_phases: where its time to the first token went, (phase, seconds) in order
            (:meth:`first_token_phases`); () before the first token.
        aborted: an Abort arrived; every later step checks it.
        error: ends the request at its next wait (the router shutting down).
        woken: done once ``aborted`` or ``error`` is set (the stream's wait watches it).
    """

    request_id: str
    start: float
    phase: Phase = Phase.ACCEPTED
    spec: RequestSpec | None = None
    eos: frozenset[int] = frozenset()
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    attempt_id: str = ""
    route: Route | None = None
    calls: dict[str, asyncio.Task] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    avoid: set[str] = field(default_factory=set)
    retries: int = 0
    migrations: int = 0
    placing_since: float = 0.0
    opened_at: float = 0.0
    placed_at: float = 0.0
    ttft_phases: tuple[tuple[str, float], ...] = ()
    aborted: bool = False
    error: RequestError | None = None
    woken: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def ended(self) -> bool:
        return self.phase.ended

    @property
    def instances(self) -> set[str]:
        """The instances the request depends on now: its route's until the first token,
        then only the main (decode or colocated) one; none while unplaced."""
        if self.route is None:
            return set()
        if self.phase is not Phase.DECODING:
            return self.route.instances
        # NOTE: a late reservation: until decode reserved, the KV is on the prefill only
        return {self.route.main or self.route.prefill}

    def accepted(self, spec: RequestSpec, eos_token_ids: tuple[int, ...], now: float) -> None:
        """Validated and tokenized at ``now``: ``spec`` is what every attempt runs."""
        self.spec, self.start, self.placing_since = spec, now, now
        eos = frozenset() if spec.sampling.ignore_eos else frozenset(eos_token_ids)
        self.eos = eos | frozenset(spec.sampling.stop_token_ids)

    def new_attempt(self, number: int | str) -> RequestSpec:
        """PLACING under attempt id "<request_id>@<number>"; returns the spec under that id:
        after tokens streamed, the prompt plus those tokens, the rest of max_tokens, and
        ``num_resumed_tokens`` so seeded sampling goes on with the same sequence."""
        self._move(Phase.PLACING)
        self.attempt_id = f"{self.request_id}@{number}"
        self.route, self.calls = None, {}
        done = len(self.output_token_ids)
        if not done:
            return replace(self.spec, request_id=self.attempt_id)
        sampling = replace(self.spec.sampling, max_tokens=self.spec.sampling.max_tokens - done)
        return replace(self.spec, request_id=self.attempt_id,
                       prompt_token_ids=self.spec.prompt_token_ids + tuple(self.output_token_ids),
                       sampling=sampling, num_resumed_tokens=done)

    def placed(self, route: Route) -> None:
        """PREFILLING: the attempt holds ``route``."""
        self._move(Phase.PREFILLING)
        self.route, self.placed_at = route, time.monotonic()

    def decoding(self) -> None:
        """DECODING: the first token is out."""
        self._move(Phase.DECODING)

    def take(self, event: TokenEvent, now: float) -> tuple[tuple[int, ...], str | None]:
        """Count ``event``'s tokens; returns (the tokens to stream: never past max_tokens nor
        past an EOS, the finish reason: the leader's, else "stop" after EOS, "length" at
        max_tokens, else None)."""
        room = self.spec.sampling.max_tokens - self.completion_tokens
        tokens = tuple(event.token_ids[:room])
        eos_at = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        tokens = tokens if eos_at is None else tokens[:eos_at + 1]
        if tokens and self.first_token_at is None:
            self.first_token_at = now
        if tokens:
            self.last_token_at = now
        self.completion_tokens += len(tokens)
        self.cached_tokens = max(self.cached_tokens, event.num_cached_tokens)
        self.output_token_ids.extend(tokens)
        if event.finish_reason is not None:
            return tokens, event.finish_reason
        if eos_at is not None:
            return tokens, "stop"
        if self.completion_tokens >= self.spec.sampling.max_tokens:
            return tokens, "length"
        return tokens, None

    def untake(self, count: int) -> None:
        """Forget the last ``count`` tokens :meth:`take` counted (a stop string ended the
        request before them: they are never sent)."""
        if count > 0:
            self.completion_tokens -= count
            del self.output_token_ids[-count:]

    async def next_event(self, inbox: Inbox, timeout_s: float) -> TokenEvent | None:
        """The current attempt's next token event; None once aborted. Waits at most
        ``timeout_s`` seconds on the inbox, the wake-up and the side calls.

        Raises:
            InstanceFailure: an instance it depends on failed (poll, health, a side call, a
                retryable error event).
            RequestError: the worker's error (INTERNAL), ``error`` (shutdown), or no event
                within ``timeout_s`` (DEADLINE_EXCEEDED).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.aborted:
                return None
            if self.error is not None:
                raise self.error
            event = inbox.take()  # NOTE: before the calls: a failed instance fails both
            if event is not None:
                return event
            self._raise_failed_call()
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestError(
                    "DEADLINE_EXCEEDED",
                    f"request {self.request_id}: no tokens from {sorted(self.instances)}"
                    f" within router.request_timeout_s={timeout_s:g} s: the instance may be "
                    "overloaded or stuck; check `orch status` and the worker logs, or raise "
                    "router.request_timeout_s")
            await asyncio.wait({inbox.ready, self.woken, *self.calls.values()}, timeout=left,
                               return_when=asyncio.FIRST_COMPLETED)

    def first_token_phases(self, event: TokenEvent, arrived: float, now: float
                           ) -> tuple[tuple[str, float], ...]:
        """The first token (``event``, which reached the router at ``arrived``) is handed to
        the client at ``now`` (monotonic): (phase, seconds) in order, stored in
        :attr:`ttft_phases`. Router phases: ``tokenize`` (opened -> validated and tokenized),
        ``placement`` (-> placed: instance choice, decode reserve), ``transport`` (placed ->
        the event at the router, less the leader's own phases: the launch call reaching the
        leader and the event's way back), then the leader's
        (:class:`rank.step_timing.FirstTokenClock`), then ``router_out`` (the event at the
        router -> the chunk handed to the server). Without the leader's phases (an older
        worker), ``transport`` is the whole placed -> event span. ``reserve_wait``, before
        ``router_out``: the time the token waited at the router for its placement to end
        (0 unless an eager PD launch, ``Route.launched_at``: then ``placement`` ends at the
        prefill call, ``transport`` starts there, and the reservation may come after the
        token); the phases add up to opened -> ``now`` either way."""
        rank = event.ttft_phases
        # NOTE: an eager PD launch: the prompt computed while decode reserved, so the launch
        # call went out at ``launched`` and the token may wait for the reservation (else 0)
        launched = self.route.launched_at if self.route is not None else None
        launched = self.placed_at if launched is None else launched
        ready = max(arrived, self.placed_at)
        self.ttft_phases = (
            ("tokenize", self.start - self.opened_at),
            ("placement", launched - self.start),
            ("transport", arrived - launched - sum(s for _, s in rank)),
            *rank, ("reserve_wait", ready - arrived), ("router_out", now - ready))
        return self.ttft_phases

    def attempt_failed(self, exc: InstanceFailure, max_attempts: int) -> None:
        """Remember a failed attempt (before the first token); the next one avoids
        ``exc.instance``.

        Raises:
            RequestError: UNAVAILABLE naming every failure, when it was attempt ``max_attempts``.
        """
        self.retries += 1
        self.failures.append(f"attempt {len(self.failures) + 1}: {exc.message}")
        self.avoid.add(exc.instance)
        if self.retries >= max_attempts:
            raise RequestError(
                "UNAVAILABLE", f"request {self.request_id} failed on {len(self.failures)} "
                f"attempt(s) (router.max_attempts={max_attempts}): {'; '.join(self.failures)}: "
                "retry later; `orch status` shows the instances")

    def migrate(self, exc: InstanceFailure, max_migrations: int, now: float) -> None:
        """Its main instance failed (or was drained) after tokens streamed: the next attempt
        runs prompt + streamed tokens elsewhere (``exc.instance`` tried last), its placement
        deadline counted from ``now``.

        Raises:
            RequestError: UNAVAILABLE naming every failure, past ``max_migrations``.
        """
        self.failures.append(f"attempt {len(self.failures) + 1} (after "
                             f"{self.completion_tokens} token(s)): {exc.message}")
        self.avoid.add(exc.instance)
        if self.migrations >= max_migrations:
            raise RequestError(
                "UNAVAILABLE", f"request {self.request_id} failed after "
                f"{self.completion_tokens} token(s) were streamed and {self.migrations} "
                f"migration(s) (router.max_migrations={max_migrations}): "
                f"{'; '.join(self.failures)}: retry the request; `orch status` shows the "
                "instances")
        self.migrations += 1
        self.placing_since = now

    def abort(self) -> None:
        """Mark it aborted and wake its wait (a later step ends it with "abort")."""
        self.aborted = True
        self._wake()

    def fail(self, error: RequestError) -> None:
        """End it with ``error`` at its next wait."""
        self.error = self.error or error
        self._wake()

    def end(self, phase: Phase) -> bool:
        """Move to an end ``phase``; returns whether that is a rejection (FAILED before
        anything was computed: while ACCEPTED, or while placing its first attempt).

        Raises:
            RuntimeError: it already ended (a router bug: metrics would count it twice).
        """
        rejected = phase is Phase.FAILED and (
            self.phase is Phase.ACCEPTED or (self.phase is Phase.PLACING and not self.failures))
        self._move(phase)
        return rejected

    def ttft(self) -> float | None:
        """Seconds from acceptance to the first token (None before it)."""
        return None if self.first_token_at is None else self.first_token_at - self.start

    def tpot(self) -> float | None:
        """Mean seconds per output token after the first (0 with one token; None before)."""
        if self.first_token_at is None or self.last_token_at is None:
            return None
        if self.completion_tokens < 2:
            return 0.0
        return (self.last_token_at - self.first_token_at) / (self.completion_tokens - 1)

    def stats(self, now: float) -> RequestStats:
        """Final statistics; instance names from the current route ("" when unplaced)."""
        main = (self.route.main or "") if self.route is not None else ""
        return RequestStats(
            prompt_tokens=self.spec.num_prompt_tokens if self.spec else 0,
            completion_tokens=self.completion_tokens, ttft_s=self.ttft() or 0.0,
            tpot_s=self.tpot() or 0.0, e2e_s=now - self.start,
            prefill_instance=(self.route.prefill if self.route else "") or main,
            decode_instance=main, cached_tokens=self.cached_tokens,
            ttft_phases=dict(self.ttft_phases))

    def _move(self, phase: Phase) -> None:
        if phase not in _NEXT.get(self.phase, ()):
            raise RuntimeError(f"request {self.request_id}: no transition {self.phase.value} "
                               f"-> {phase.value} (a router bug)")
        self.phase = phase

    def _raise_failed_call(self) -> None:
        """Forget the side calls that ended; raise the failure of one whose instance the
        request still depends on (a launch failing after the first token does not count,
        but for an eager PD launch's: its ``Attach`` never came, so decode gets no KV)."""
        for name, call in list(self.calls.items()):
            if not call.done() or call.cancelled():
                continue
            del self.calls[name]
            exc = call.exception()
            needed = self.instances
            # NOTE: a late reservation's Attach is in the handover
            if name in ("launch", "handover") and self.route is not None \
                    and self.route.prefill_call is not None:
                needed = needed | {self.route.prefill}
            if isinstance(exc, InstanceFailure) and exc.instance in needed:
                raise request_failed(self.request_id, exc.instance, exc.message, retryable=True)
            if exc is not None and not isinstance(exc, InstanceFailure):
                raise exc

    def _wake(self) -> None:
        if not self.woken.done():
            self.woken.set_result(None)

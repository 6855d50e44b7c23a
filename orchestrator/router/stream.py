"""Per-request streaming state: token counters, finish decision, timing statistics.

Counters, not phases: ``completion_tokens`` and the timestamps say where the request is.
Times are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

from rank.messages import TokenEvent
from engine.request import RequestSpec
from orchestrator.config.checkpoint import ModelInfo
from orchestrator.router.request import RequestStats


class StreamProgress:
    """What one request has produced so far.

    Args:
        spec: the accepted request.
        model: for EOS ids.
        start: when the router accepted it (monotonic seconds).
    """

    def __init__(self, spec: RequestSpec, model: ModelInfo, start: float) -> None:
        self.spec, self.start = spec, start
        self._eos = set() if spec.sampling.ignore_eos else set(model.eos_token_ids)
        self.completion_tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.first_event_now = False  # the last add() brought the first token(s)
        self.done = False  # the request reached a finish (nothing left to abort)
        self.recorded = False  # metrics already told
        self._last: tuple[int, ...] = ()  # tokens of the last add()

    def add(self, event: TokenEvent, now: float) -> tuple[int, ...]:
        """Count the event's tokens (never past max_tokens); returns the tokens to emit."""
        room = self.spec.sampling.max_tokens - self.completion_tokens
        tokens = tuple(event.token_ids[:room])
        if self._eos:
            eos_at = next((i for i, t in enumerate(tokens) if t in self._eos), None)
            tokens = tokens if eos_at is None else tokens[:eos_at + 1]
        self.first_event_now = bool(tokens) and self.completion_tokens == 0
        if self.first_event_now:
            self.first_token_at = now
        if tokens:
            self.last_token_at = now
        self.completion_tokens += len(tokens)
        self._last = tokens
        return tokens

    def finish_reason(self, event: TokenEvent) -> str | None:
        """The leader's finish reason, else "stop" after EOS, "length" at max_tokens."""
        if event.finish_reason is not None:
            return event.finish_reason
        if self._last and self._last[-1] in self._eos:
            return "stop"
        if self.completion_tokens >= self.spec.sampling.max_tokens:
            return "length"
        return None

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

    def stats(self, route, now: float) -> RequestStats:
        """Final statistics (``route`` gives the instance names; None: never placed)."""
        main = route.main if route is not None else ""
        return RequestStats(
            prompt_tokens=self.spec.num_prompt_tokens,
            completion_tokens=self.completion_tokens, ttft_s=self.ttft() or 0.0,
            tpot_s=self.tpot() or 0.0, e2e_s=now - self.start,
            prefill_instance=(route.prefill if route is not None else "") or main,
            decode_instance=main)

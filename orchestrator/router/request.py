"""Router-edge request and response values (what convert.py maps protobuf to and from).

``GenerateInput`` is a client request before validation/tokenization; the router turns it
into an :class:`rank.messages.RequestSpec`. ``OutputChunk`` is one streamed response message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams, TokenLogprobs
from rank.step_timing import FIRST_TOKEN_PHASES

# The way to the first token, in order: the router's phases around the leader's
# (``RequestState.first_token_phases``); what ``RequestStats.ttft_phases`` holds.
# ``reserve_wait``: the first token waiting at the router for the reservation (0 unless an
# eager PD launch, whose prompt computes while decode reserves).
TTFT_PHASES = ("tokenize", "placement", "transport", *FIRST_TOKEN_PHASES, "reserve_wait",
               "router_out")


class RequestError(Exception):
    """A request failed with a gRPC-style status code and an actionable message.

    Attributes:
        code: a ``grpc.StatusCode`` name: "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED",
            "DEADLINE_EXCEEDED", "UNAVAILABLE", "INTERNAL", "ALREADY_EXISTS", "CANCELLED".
        message: what went wrong and what to do.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InstanceFailure(RequestError):
    """An instance failed while a request depended on it (dead, unreachable, broken): not the
    request's fault. UNAVAILABLE; before the request's first token the router places it again
    elsewhere (``router.max_attempts``).

    Attributes:
        instance: the failed instance's name ("decode-0").
    """

    def __init__(self, instance: str, message: str) -> None:
        super().__init__("UNAVAILABLE", message)
        self.instance = instance


def request_failed(request_id: str, instance: str, error: str,
                   retryable: bool) -> RequestError:
    """The error that ends ``request_id`` because of ``instance``: :class:`InstanceFailure`
    when the instance failed (``retryable``), else INTERNAL (the worker's error for this
    request: never run again). The message is "request <id> failed on <instance>: <error>"."""
    where = f" on {instance}" if instance else ""
    message = f"request {request_id} failed{where}: {error}"
    return InstanceFailure(instance, message) if retryable else RequestError("INTERNAL", message)


@dataclass(frozen=True)
class GenerateInput:
    """A client request as received.

    Exactly one of ``text`` / ``token_ids`` is set; ``sampling`` is range-checked already;
    ``request_id`` "" asks for a router-made id; ``stop``: stop strings (the router cuts the
    text before the first one found, ``orchestrator.router.stop_text``).
    """

    text: str | None
    token_ids: tuple[int, ...] | None
    sampling: SamplingParams
    request_id: str = ""
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequestStats:
    """Final statistics of one request (seconds, tokens).

    ttft_s: acceptance -> first token; tpot_s: mean gap between output tokens after the first
    (0 with one token); e2e_s: acceptance -> last message; cached_tokens: prompt tokens found
    in the prefix cache (not computed); ttft_phases: phase -> seconds of the way to the first
    token, from the router opening the request (``RequestState.first_token_phases``; empty
    without a token).
    """

    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_instance: str = ""
    decode_instance: str = ""
    cached_tokens: int = 0
    ttft_phases: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OutputChunk:
    """One streamed message: new tokens and their text; the last one has finish + stats.
    ``index``: the choice it belongs to (``n`` > 1, ``orchestrator.router.fan_out``)."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    stats: RequestStats | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked
    index: int = 0

"""What one benchmark run records: the runner's settings, one record per request (times of
every streamed message), the run's result, and the per-stream state a backend fills in.
Times are ``time.perf_counter()`` seconds from the run's origin."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal

from orchestrator.bench.workloads import BenchRequest

BACKSTOP_SLACK_S = 5.0  # NOTE: asyncio bound beyond the server's deadline, in case it never fires.
_OK_FINISH = ("stop", "length")


@dataclass(frozen=True)
class RunnerConfig:
    """How to drive the server.

    Attributes:
        address: router ``host:port``. max_concurrency: requests in flight (None: unbounded).
        request_timeout_s, connect_timeout_s: one request's gRPC deadline and the wait for
            the channel to be ready, seconds.
        label: prefix of request ids (``<label>-<run id>-<index>``).
        backend: "grpc" (orch's Generate at ``address``) or "openai" (streamed
            ``/completions`` at ``base_url``, e.g. ``http://127.0.0.1:8000/v1``).
        model: the openai backend's model name (None: the first ``GET /models`` lists).
        tls_ca: PEM file (CA or self-signed certificate) to trust for a TLS router or an
            https ``base_url`` (None: plaintext gRPC, the system CAs for https).
        token: bearer token sent by both backends (``authorization: Bearer``; None: none).
    """

    address: str = "127.0.0.1:50051"
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    label: str = "bench"
    progress: bool = True
    backend: Literal["grpc", "openai"] = "grpc"
    base_url: str | None = None
    model: str | None = None
    tls_ca: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        if self.backend == "openai" and not self.base_url:
            raise ValueError("--backend openai needs --base-url URL (e.g. "
                             "http://127.0.0.1:8000/v1)")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("--request-timeout and --connect-timeout must be > 0 seconds")


@dataclass(frozen=True)
class RequestRecord:
    """What happened to one request; times are seconds on the run's clock (0 = timed start).

    Attributes:
        index: workload index. warmup: not in the statistics.
        input_len: prompt tokens (the server's count when its final stats carried one).
        output_len: tokens asked for. scheduled_s: due time from the workload.
        send_s: when ``Generate`` was called (after the concurrency slot was free).
        chunk_times_s, chunk_tokens: arrival time and tokens of each message carrying tokens.
        end_s: when the stream ended (final message, error or timeout).
        finish_reason: the final message's reason ("stop", "length", "abort"), or None.
        error_code: gRPC status name on failure ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
            ...), "NO_FINISH" when the stream ended without a finish reason, "ABORTED_BY_SERVER"
            for finish_reason "abort"; None on success.
        error: the failure's message, or None.
        cached_tokens: prompt tokens the server found in its prefix cache (final stats).
        ttft_phases: the server's TTFT breakdown, phase -> seconds (final stats; empty from a
            server or backend that sends none).
    """

    index: int
    warmup: bool
    input_len: int
    output_len: int
    scheduled_s: float
    send_s: float
    chunk_times_s: tuple[float, ...]
    chunk_tokens: tuple[int, ...]
    end_s: float
    finish_reason: str | None
    error_code: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    ttft_phases: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error_code is None

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        """Send -> first message with a token, seconds (None without tokens)."""
        return self.chunk_times_s[0] - self.send_s if self.chunk_times_s else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s


@dataclass(frozen=True)
class RunResult:
    """All records of one run.

    Attributes:
        records: warm-up records first, then the timed ones in workload order.
        duration_s: timed phase, first due time (0) to the last stream's end, seconds.
        started_at: ``time.time()`` when the timed phase started.
    """

    records: tuple[RequestRecord, ...]
    duration_s: float
    started_at: float


class StreamState:
    """Mutable state of one call while it streams, frozen into a :class:`RequestRecord` at
    the end (same meanings; ``code, error``: gRPC status name and message, or None)."""

    def __init__(self, send_s: float, input_len: int) -> None:
        self.send_s = send_s
        self.input_len = input_len
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.code: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0
        self.ttft_phases: dict[str, float] = {}

    def record(self, req: BenchRequest, end_s: float) -> RequestRecord:
        """The finished request (a stream without an ok finish is a failure)."""
        if self.code is None and self.finish is None:
            self.code, self.error = "NO_FINISH", "stream ended without a finish_reason"
        elif self.code is None and self.finish not in _OK_FINISH:
            self.code, self.error = "ABORTED_BY_SERVER", f"finish_reason={self.finish!r}"
        return RequestRecord(
            index=req.index, warmup=req.warmup, input_len=self.input_len,
            output_len=req.output_len, scheduled_s=req.arrival_s, send_s=self.send_s,
            chunk_times_s=tuple(self.times), chunk_tokens=tuple(self.tokens), end_s=end_s,
            finish_reason=self.finish, error_code=self.code, error=self.error,
            cached_tokens=self.cached_tokens, ttft_phases=self.ttft_phases)


# One request sent now and streamed to its end: (request, run clock origin t0, run id).
Send = Callable[[BenchRequest, float, str], Awaitable[RequestRecord]]


# One request sent now and streamed to its end: (request, run clock origin t0, run id).
Send = Callable[[BenchRequest, float, str], Awaitable[RequestRecord]]

"""Replay a workload against a running router over gRPC (grpc.aio), or against any
OpenAI-compatible server (``backend="openai"``, :mod:`orchestrator.bench.openai_backend`), and
time every token.

Each timed request is a task that sleeps until its arrival time, waits for a concurrency slot
(``max_concurrency``), sends ``Generate`` (greedy, ``ignore_eos``, ``max_tokens =
output_len``) and stamps every streamed message with ``time.perf_counter()``. Warm-up requests
go first, one at a time, and are kept apart. Every wait is bounded: the channel must be ready
within ``connect_timeout_s`` and each call has a gRPC deadline of ``request_timeout_s`` (plus
an asyncio backstop), so the run ends by itself.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, Literal

import grpc

from orchestrator.bench.workloads import BenchRequest, Workload
from orchestrator.client import bearer_metadata, credentials
from orchestrator.rpc import orch_pb2, orch_pb2_grpc

_BACKSTOP_SLACK_S = 5.0  # NOTE: asyncio bound beyond the gRPC deadline, in case it never fires.
_OK_FINISH = ("stop", "length")


@dataclass(frozen=True)
class RunnerConfig:
    """How to drive the server.

    Attributes:
        address: router ``host:port``.
        max_concurrency: most requests in flight (None = unbounded).
        request_timeout_s: gRPC deadline of one request, seconds.
        connect_timeout_s: how long to wait for the channel to become ready, seconds.
        label: prefix of request ids (``<label>-<run id>-<index>``).
        progress: show a tqdm progress bar on stderr.
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
        index: the request's workload index.
        warmup: a warm-up request (not in the statistics).
        input_len: prompt tokens (the server's count when its final stats carried one).
        output_len: tokens asked for.
        scheduled_s: due time from the workload.
        send_s: when ``Generate`` was called (after the concurrency slot was free).
        chunk_times_s: arrival time of each message carrying tokens.
        chunk_tokens: tokens in each of those messages.
        end_s: when the stream ended (final message, error or timeout).
        finish_reason: the final message's reason ("stop", "length", "abort"), or None.
        error_code: gRPC status name on failure ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
            ...), "NO_FINISH" when the stream ended without a finish reason, "ABORTED_BY_SERVER"
            for finish_reason "abort"; None on success.
        error: the failure's message, or None.
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


def make_request(req: BenchRequest, request_id: str) -> orch_pb2.GenerateRequest:
    """The ``GenerateRequest`` of ``req``: its prompt, greedy, exactly ``output_len`` tokens."""
    sampling = orch_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0,
                                       max_tokens=req.output_len, ignore_eos=True)
    if req.prompt_text is not None:
        return orch_pb2.GenerateRequest(text=req.prompt_text, sampling=sampling,
                                        request_id=request_id)
    ids = orch_pb2.TokenIds(ids=req.prompt_token_ids.tolist())
    return orch_pb2.GenerateRequest(token_ids=ids, sampling=sampling, request_id=request_id)


class StreamState:
    """Mutable state of one call while it streams (frozen into a RequestRecord at the end).

    Attributes:
        send_s: when it was sent (run clock, seconds).
        input_len: prompt tokens (the server's count once it gave one).
        times, tokens: arrival time and token count of each message carrying tokens.
        finish: the finish reason, once seen.
        code, error: the failure (gRPC status name, message), or None.
    """

    def __init__(self, send_s: float, input_len: int) -> None:
        self.send_s = send_s
        self.input_len = input_len
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.code: str | None = None
        self.error: str | None = None

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
            finish_reason=self.finish, error_code=self.code, error=self.error)


# One request sent now and streamed to its end: (request, run clock origin t0, run id).
Send = Callable[[BenchRequest, float, str], Awaitable[RequestRecord]]


async def _consume(stub, req: BenchRequest, rid: str, st: StreamState, cfg: RunnerConfig,
                   t0: float) -> None:
    call = stub.Generate(make_request(req, rid), timeout=cfg.request_timeout_s,
                         metadata=bearer_metadata(cfg.token))
    try:
        async for msg in call:
            now = time.perf_counter() - t0
            if msg.token_ids:
                st.times.append(now)
                st.tokens.append(len(msg.token_ids))
            if msg.finish_reason:
                st.finish = msg.finish_reason
                if msg.HasField("stats") and msg.stats.prompt_tokens > 0:
                    st.input_len = msg.stats.prompt_tokens
    except asyncio.CancelledError:
        call.cancel()
        raise


async def send_one(stub, req: BenchRequest, cfg: RunnerConfig, t0: float,
                   run_id: str) -> RequestRecord:
    """Send ``req`` now and record its stream; never raises for a failed request."""
    st = StreamState(time.perf_counter() - t0, req.input_len)
    rid = f"{cfg.label}-{run_id}-{req.index}"
    try:
        await asyncio.wait_for(_consume(stub, req, rid, st, cfg, t0),
                               cfg.request_timeout_s + _BACKSTOP_SLACK_S)
    except grpc.aio.AioRpcError as e:
        st.code, st.error = e.code().name, e.details()
    except asyncio.TimeoutError:
        st.code, st.error = "DEADLINE_EXCEEDED", "client backstop timeout"
    return st.record(req, time.perf_counter() - t0)


async def _timed(send: Send, req: BenchRequest, t0: float, run_id: str,
                 sem: asyncio.Semaphore | None, bar) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    if sem is None:
        rec = await send(req, t0, run_id)
    else:
        async with sem:
            rec = await send(req, t0, run_id)
    bar.update(1)
    return rec


class _NoBar:
    """Stands in for tqdm when there is no progress bar (tqdm starts a monitor thread even
    when disabled)."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _progress_bar(total: int, cfg: RunnerConfig):
    if not cfg.progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", desc=cfg.label)


async def connect(address: str, timeout_s: float, tls_ca: str | None = None,
                  token: str | None = None) -> grpc.aio.Channel:
    """A ready channel to ``address`` (TLS trusting ``tls_ca`` when given) whose router takes
    ``token``.

    Raises:
        ConnectionError: not ready within ``timeout_s``, or the router answers UNAUTHENTICATED
            (message says which option to pass).
        OSError: ``tls_ca`` cannot be read.
    """
    options = [("grpc.max_send_message_length", 256 << 20),
               ("grpc.max_receive_message_length", 256 << 20)]
    creds = credentials(tls_ca)
    channel = (grpc.aio.insecure_channel(address, options=options) if creds is None
               else grpc.aio.secure_channel(address, creds, options=options))
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
        await _check_token(channel, address, timeout_s, token)
    except asyncio.TimeoutError:
        await channel.close()
        tls = ("a router with router.tls needs --tls-ca FILE" if tls_ca is None else
               f"is its certificate signed by {tls_ca} and valid for this address?")
        raise ConnectionError(
            f"no orch server answered at {address} within {timeout_s:g}s: start one with "
            f"`orch up CONFIG` or pass --address HOST:PORT of a running router ({tls})") from None
    except BaseException:
        await channel.close()
        raise
    return channel


async def _check_token(channel: grpc.aio.Channel, address: str, timeout_s: float,
                       token: str | None) -> None:
    """Fail the run at once, not per request, when the router refuses ``token``: one
    ``GetStatus`` call (any other outcome, e.g. UNIMPLEMENTED, lets the run go on)."""
    try:
        await orch_pb2_grpc.OrchStub(channel).GetStatus(
            orch_pb2.GetStatusRequest(), timeout=timeout_s, metadata=bearer_metadata(token))
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise ConnectionError(
                f"router at {address} answered UNAUTHENTICATED ({e.details()}): pass "
                "--token-file FILE or set $ORCH_TOKEN to the router's token") from None


async def run_benchmark(workload: Workload, cfg: RunnerConfig) -> RunResult:
    """Send the warm-up requests one by one, then replay the timed ones on schedule.

    Raises:
        ConnectionError: the server is not reachable within ``cfg.connect_timeout_s``.
    """
    run_id = secrets.token_hex(3)
    async with _sender(cfg) as send:
        warm = [await send(r, time.perf_counter(), run_id) for r in workload.warmup]
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        with _progress_bar(len(workload.requests), cfg) as bar:
            started_at, t0 = time.time(), time.perf_counter()
            timed = await asyncio.gather(*(
                _timed(send, r, t0, run_id, sem, bar) for r in workload.requests))
            duration = time.perf_counter() - t0
    return RunResult(records=tuple(warm) + tuple(timed), duration_s=duration,
                     started_at=started_at)


@asynccontextmanager
async def _sender(cfg: RunnerConfig) -> AsyncIterator[Send]:
    """The backend's :data:`Send`, connected (ConnectionError when nothing answers)."""
    if cfg.backend == "openai":
        from orchestrator.bench.openai_backend import openai_sender

        async with openai_sender(cfg) as send:
            yield send
        return
    channel = await connect(cfg.address, cfg.connect_timeout_s, cfg.tls_ca, cfg.token)
    try:
        stub = orch_pb2_grpc.OrchStub(channel)
        yield lambda req, t0, run_id: send_one(stub, req, cfg, t0, run_id)
    finally:
        await channel.close()

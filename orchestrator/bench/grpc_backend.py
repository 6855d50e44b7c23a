"""The gRPC backend of ``orch bench``: one ``Generate`` stream per request against an orch
router (grpc.aio), every streamed message stamped. Every wait is bounded: the channel must be
ready within ``connect_timeout_s`` and each call has a gRPC deadline of ``request_timeout_s``
plus an asyncio backstop."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import grpc

from orchestrator.api.client import bearer_metadata, credentials
from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc
from orchestrator.bench.records import (BACKSTOP_SLACK_S, RequestRecord, RunnerConfig, Send,
                                        StreamState)
from orchestrator.bench.workloads import BenchRequest


def make_request(req: BenchRequest, request_id: str) -> orch_pb2.GenerateRequest:
    """The ``GenerateRequest`` of ``req``: its prompt, greedy, exactly ``output_len`` tokens."""
    sampling = orch_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=0,
                                       max_tokens=req.output_len, ignore_eos=True)
    if req.prompt_text is not None:
        return orch_pb2.GenerateRequest(text=req.prompt_text, sampling=sampling,
                                        request_id=request_id)
    ids = orch_pb2.TokenIds(ids=req.prompt_token_ids.tolist())
    return orch_pb2.GenerateRequest(token_ids=ids, sampling=sampling, request_id=request_id)


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
                    st.cached_tokens = msg.stats.cached_tokens
                    st.ttft_phases = dict(msg.stats.ttft_phases)
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
                               cfg.request_timeout_s + BACKSTOP_SLACK_S)
    except grpc.aio.AioRpcError as e:
        st.code, st.error = e.code().name, e.details()
    except asyncio.TimeoutError:
        st.code, st.error = "DEADLINE_EXCEEDED", "client backstop timeout"
    return st.record(req, time.perf_counter() - t0)


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


@asynccontextmanager
async def grpc_sender(cfg: RunnerConfig) -> AsyncIterator[Send]:
    """A connected :data:`Send` over gRPC (ConnectionError when nothing answers)."""
    channel = await connect(cfg.address, cfg.connect_timeout_s, cfg.tls_ca, cfg.token)
    try:
        stub = orch_pb2_grpc.OrchStub(channel)
        yield lambda req, t0, run_id: send_one(stub, req, cfg, t0, run_id)
    finally:
        await channel.close()

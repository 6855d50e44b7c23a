"""A scripted fake Orch gRPC server for bench tests, run on its own event loop thread.

Request ``<label>-<run>-<i>``: fails with RESOURCE_EXHAUSTED when ``i % fail_every == 0``;
otherwise waits ``ttft_s``, then streams ``max_tokens`` tokens ``tokens_per_msg`` at a time
with ``itl_s`` between messages, and a final message with finish_reason "length" and stats.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from orchestrator.api.rpc import orch_pb2, orch_pb2_grpc


class FakeOrch(orch_pb2_grpc.OrchServicer):
    def __init__(self, ttft_s: float, itl_s: float, fail_every: int = 0,
                 tokens_per_msg: int = 1) -> None:
        self.ttft_s, self.itl_s = ttft_s, itl_s
        self.fail_every, self.tokens_per_msg = fail_every, tokens_per_msg
        self.requests: list[orch_pb2.GenerateRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def Generate(self, request, context):
        self.requests.append(request)
        idx = int(request.request_id.rsplit("-", 1)[1])
        if self.fail_every and idx % self.fail_every == 0:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode full, retry later")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.ttft_s)
            n, sent = request.sampling.max_tokens, 0
            while sent < n:
                k = min(self.tokens_per_msg, n - sent)
                yield orch_pb2.GenerateResponse(request_id=request.request_id,
                                                token_ids=list(range(sent, sent + k)))
                sent += k
                if sent < n:
                    await asyncio.sleep(self.itl_s)
            prompt = len(request.token_ids.ids) or len(request.text.split())
            yield orch_pb2.GenerateResponse(
                request_id=request.request_id, finish_reason="length",
                stats=orch_pb2.GenerateStats(prompt_tokens=prompt, completion_tokens=n))
        finally:
            self.in_flight -= 1


class FakeServer:
    """Serves a :class:`FakeOrch` on 127.0.0.1:<free port> from a background thread."""

    def __init__(self, servicer: FakeOrch) -> None:
        self.servicer = servicer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-orch",
                                       daemon=True)
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        orch_pb2_grpc.add_OrchServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(10)
        # NOTE: grpc.aio runs the base servicer's unimplemented GetStatus (the bench's token
        # check calls it) on the loop's default executor: join that thread too.
        asyncio.run_coroutine_threadsafe(self.loop.shutdown_default_executor(),
                                         self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

"""Python client for the orch router (sync :class:`OrchClient`, async :class:`AsyncOrchClient`).

Errors arrive as ``grpc.RpcError`` (sync) / ``grpc.aio.AioRpcError`` (async) with the router's
status code and message (``.code()``, ``.details()``). A router with ``router.tls`` needs
``tls_ca`` (the PEM file of the CA, or the self-signed certificate, that signed its
certificate); one with ``router.auth`` needs ``token`` (sent as ``authorization: Bearer``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import envs
from engine.sampling_params import SamplingParams
from orchestrator.api import convert
from orchestrator.router.request import GenerateInput, OutputChunk, RequestStats
from orchestrator.api.rpc import orch_pb2 as pb
from orchestrator.api.rpc import orch_pb2_grpc as pb_grpc
from orchestrator.status import InstanceView


def _request(prompt: str | None, token_ids: list[int] | None, request_id: str,
             stop: Sequence[str] = (), n: int = 1, **sampling: object) -> pb.GenerateRequest:
    """Build the proto request; ``stop``: stop strings; ``n``: choices (chunks carry their
    ``index``); ``sampling`` are SamplingParams fields (max_tokens, ...)."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("pass exactly one of prompt (text) or token_ids")
    inp = GenerateInput(text=prompt, token_ids=None if token_ids is None else tuple(token_ids),
                        sampling=SamplingParams(**sampling), request_id=request_id,
                        stop=tuple(stop))
    return convert.generate_input_to_proto(inp, n)


def credentials(tls_ca: str | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the PEM file ``tls_ca``, or None for plaintext.

    Raises:
        OSError: the file cannot be read.
    """
    if tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).expanduser().read_bytes())


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata carrying ``token`` as ``authorization: Bearer``, or None."""
    return None if token is None else (("authorization", f"Bearer {token}"),)


def resolve_token(token_file: str | None) -> str | None:
    """The bearer token: the stripped contents of ``token_file``, else ``$ORCH_TOKEN``, else
    None (an empty file or variable is None).

    Raises:
        OSError: ``token_file`` cannot be read.
    """
    if token_file:
        return Path(token_file).expanduser().read_text().strip() or None
    return envs.ORCH_TOKEN.get() or None


def _collect(chunks: list[OutputChunk]) -> tuple[str, list[int], RequestStats | None]:
    text = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    return text, ids, chunks[-1].stats if chunks else None


class OrchClient:
    """Blocking client of the router at ``address`` ("host:port"); ``tls_ca`` / ``token``
    as the module doc says (None: plaintext / no token).

    Raises:
        OSError: ``tls_ca`` cannot be read.
    """

    def __init__(self, address: str, tls_ca: str | None = None,
                 token: str | None = None) -> None:
        self.address = address
        creds = credentials(tls_ca)
        self.channel = (grpc.insecure_channel(address) if creds is None
                        else grpc.secure_channel(address, creds))
        self.metadata = bearer_metadata(token)
        self.stub = pb_grpc.OrchStub(self.channel)
        self.admin = pb_grpc.AdminStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "OrchClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: str | None = None, token_ids: list[int] | None = None,
                 request_id: str = "", timeout_s: float | None = None,
                 **sampling: object) -> Iterator[OutputChunk]:
        """Stream one request's chunks (the last has finish_reason and stats; with ``n`` > 1
        each choice's, told apart by ``OutputChunk.index``). ``sampling``: SamplingParams
        fields, ``stop`` (stop strings) and ``n``."""
        call = self.stub.Generate(_request(prompt, token_ids, request_id, **sampling),
                                  timeout=timeout_s, metadata=self.metadata)
        for msg in call:
            yield convert.chunk_from_proto(msg)

    def generate_text(self, prompt: str | None = None, token_ids: list[int] | None = None,
                      **kwargs: object) -> tuple[str, list[int], RequestStats | None]:
        """Run one request to the end: (text, token ids, final stats)."""
        return _collect(list(self.generate(prompt, token_ids, **kwargs)))

    def status(self, timeout_s: float = 10.0) -> tuple[list[InstanceView], int, str]:
        """(instance rows with health and load, requests in flight, model name)."""
        msg = self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s,
                                  metadata=self.metadata)
        return convert.status_from_proto(msg), msg.in_flight, msg.model

    def abort(self, request_id: str, timeout_s: float = 10.0) -> bool:
        """Abort a request; True when the router knew it."""
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout_s,
                               metadata=self.metadata).found

    def scale(self, counts: dict[str, int], timeout_s: float | None = None) -> pb.ScaleResponse:
        """Admin.Scale: bring each role to its instance count (returns once added instances
        serve and removed ones are gone). Raises grpc.RpcError: FAILED_PRECONDITION for a
        refusal (the details say why and what to do)."""
        return self.admin.Scale(pb.ScaleRequest(counts=counts), timeout=timeout_s,
                                metadata=self.metadata)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the health service says SERVING.

        Raises:
            TimeoutError: not SERVING within ``timeout_s`` (message says where it looked).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                resp = self._health.Check(health_pb2.HealthCheckRequest(), timeout=max(left, 0.1))
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if left <= 0:
                raise TimeoutError(f"router at {self.address} not SERVING after {timeout_s} s: "
                                   "is `orch up` running there? check its log")
            time.sleep(min(0.2, max(left, 0)))


class AsyncOrchClient:
    """asyncio client (grpc.aio); create and use it inside a running loop. Arguments as
    :class:`OrchClient`'s."""

    def __init__(self, address: str, tls_ca: str | None = None,
                 token: str | None = None) -> None:
        self.address = address
        creds = credentials(tls_ca)
        self.channel = (grpc.aio.insecure_channel(address) if creds is None
                        else grpc.aio.secure_channel(address, creds))
        self.metadata = bearer_metadata(token)
        self.stub = pb_grpc.OrchStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, prompt: str | None = None, token_ids: list[int] | None = None,
                       request_id: str = "", timeout_s: float | None = None,
                       **sampling: object) -> AsyncIterator[OutputChunk]:
        """Stream one request's chunks (cancelling the iteration cancels the request);
        ``sampling`` as :meth:`OrchClient.generate`."""
        call = self.stub.Generate(_request(prompt, token_ids, request_id, **sampling),
                                  timeout=timeout_s, metadata=self.metadata)
        try:
            async for msg in call:
                yield convert.chunk_from_proto(msg)
        finally:
            call.cancel()

    async def generate_text(self, prompt: str | None = None, token_ids: list[int] | None = None,
                            **kwargs: object) -> tuple[str, list[int], RequestStats | None]:
        """Run one request to the end: (text, token ids, final stats)."""
        return _collect([c async for c in self.generate(prompt, token_ids, **kwargs)])

    async def status(self, timeout_s: float = 10.0) -> tuple[list[InstanceView], int, str]:
        msg = await self.stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s,
                                        metadata=self.metadata)
        return convert.status_from_proto(msg), msg.in_flight, msg.model

    async def abort(self, request_id: str, timeout_s: float = 10.0) -> bool:
        resp = await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout_s,
                                     metadata=self.metadata)
        return resp.found

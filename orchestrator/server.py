"""gRPC front end: the Orch servicer, the standard health service, graceful stop.

Errors leave as gRPC status codes carrying :class:`RequestError` messages. Stop order: health
NOT_SERVING (load balancers stop sending), router refuses new requests and drains in-flight
ones (bounded), ``server.stop(grace)``.
"""

from __future__ import annotations

import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from orchestrator import convert
from orchestrator.request import RequestError
from orchestrator.router import Router
from orchestrator.rpc import orch_pb2 as pb
from orchestrator.rpc import orch_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "orch.v1.Orch"


class PortInUseError(RuntimeError):
    """A port orch must listen on is taken; the message names the config key."""


class OrchServicer(pb_grpc.OrchServicer):
    """Maps the Orch RPCs onto a :class:`Router`."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            inp = convert.generate_input_from_proto(request)
            async for chunk in self.router.generate(inp):
                yield convert.chunk_to_proto(chunk)
        except RequestError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        except Exception as exc:  # noqa: BLE001 -- a bug must still end the stream clearly
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"router error: {type(exc).__name__}: {exc}; see router log")

    async def Abort(self, request: pb.AbortRequest,
                    context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self.router.abort(request.request_id))

    async def GetStatus(self, request: pb.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        statuses = await self.router.status()
        return convert.status_to_proto(statuses, self.router.in_flight, self.router.model.name)


class OrchServer:
    """A grpc.aio server around one router.

    Args:
        router: the router (started by :meth:`start`).
        host, port: where to listen (port 0 = any free port; see ``self.port``).
    """

    def __init__(self, router: Router, host: str, port: int) -> None:
        self.router = router
        self.health = health.aio.HealthServicer()
        # NOTE: gRPC enables SO_REUSEPORT by default, which lets a second `orch up` bind the
        # same port and silently share clients with this one.
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_OrchServicer_to_server(OrchServicer(router), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.address = f"{host}:{port}"
        self.port = 0

    async def start(self) -> int:
        """Bind, start the router and the server, report SERVING; returns the bound port.

        Raises:
            PortInUseError: the address could not be bound (message says what to do).
        """
        try:
            self.port = self.server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise PortInUseError(f"cannot listen on {self.address} ({exc}): pick a free "
                                 "router.port or stop what uses it") from None
        self.router.start()
        await self.server.start()
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING, drain the router (bounded by ``grace_s``), then stop the server."""
        for service in ("", SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.router.stop(drain_timeout_s=grace_s)
        await self.server.stop(grace_s)

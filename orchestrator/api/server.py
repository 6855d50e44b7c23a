"""gRPC front end: the Orch servicer, the standard health service, reflection, graceful stop.

Errors leave as gRPC status codes carrying :class:`RequestError` messages; the edge
(``orchestrator.api.interceptors``, ``orchestrator.api.security``) does token auth, size and
parse checks and TLS. Health is SERVING while every role has a healthy instance, NOT_SERVING
otherwise and from the start of shutdown. NOTE: stop order is health NOT_SERVING, router
drains in-flight requests (bounded), health monitor stops, ``server.stop(grace)``.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from orchestrator.api import convert
from orchestrator.deploy.health import InstanceHealth
from orchestrator.api.interceptors import RequestGuard, TokenAuth
from orchestrator.router.fan_out import merge_streams
from orchestrator.router.limits import DEFAULT_MAX_MESSAGE_BYTES, max_request_bytes
from orchestrator.router.peers import Peers
from orchestrator.router.request import RequestError
from orchestrator.router.router import Router
from orchestrator.api.rpc import orch_pb2 as pb
from orchestrator.api.rpc import orch_pb2_grpc as pb_grpc
from orchestrator.api.security import EdgeSecurity
from orchestrator.status import StatusBoard

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Orch"].full_name  # "orch.v1.Orch"


class PortInUseError(RuntimeError):
    """A port orch must listen on is taken; the message names the config key."""


class OrchServicer(pb_grpc.OrchServicer):
    """Maps the Orch RPCs onto a :class:`Router` and its :class:`StatusBoard`."""

    def __init__(self, router: Router, board: StatusBoard, peers: Peers | None = None) -> None:
        self.router, self.board, self.peers = router, board, peers

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            inputs = convert.choices_from_proto(request)
            if len(inputs) == 1:
                async for chunk in self.router.generate(inputs[0]):
                    yield convert.chunk_to_proto(chunk)
                return
            # NOTE: n choices on one stream; leaving (an error, a cancel) closes them all
            streams = [self.router.generate(inp) for inp in inputs]
            async with aclosing(merge_streams(streams)) as merged:
                async for index, chunk in merged:
                    yield convert.chunk_to_proto(replace(chunk, index=index))
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
        try:
            request_id = convert.abort_id_from_proto(request)
        except RequestError as exc:
            await context.abort(grpc.StatusCode[exc.code], exc.message)
        found = await self.router.abort(request_id)
        if not found and self.peers is not None:  # NOTE: placed by another router replica
            found = await self.peers.abort(request_id)
        return pb.AbortResponse(found=found)

    async def GetStatus(self, request: pb.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> pb.GetStatusResponse:
        views = await self.board.views()  # NOTE: bounded, whatever the instances do
        return convert.status_to_proto(views, self.router.in_flight, self.router.model.name)


class OrchServer:
    """A grpc.aio server around one router.

    ``board``: instance rows for GetStatus; its health monitor drives the health service.
    ``port`` 0 = any free port (``self.port``). ``max_message_bytes``: gRPC's receive limit,
    raised to the edge limit when lower (a request between the two gets INVALID_ARGUMENT from
    the edge, one over it gRPC's RESOURCE_EXHAUSTED). ``admin``: the Admin (scaling)
    servicer, served behind the same token (None: no Admin service). ``peers``: the other
    router replicas (an Abort this router does not know is asked of them). ``reuse_port``:
    share ``port`` with the other replicas (SO_REUSEPORT; every one must set it).
    """

    def __init__(self, router: Router, board: StatusBoard, host: str, port: int,
                 security: EdgeSecurity = EdgeSecurity(),
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 admin: pb_grpc.AdminServicer | None = None, peers: Peers | None = None,
                 reuse_port: bool = False) -> None:
        self.router, self.monitor = router, board.monitor
        self.security = security
        self.health = health.aio.HealthServicer()
        self._serving: bool | None = None  # what the health service says now
        self._health_updates: set[asyncio.Task] = set()
        max_len = router.model.max_model_len
        limit = max_request_bytes(max_len, router.tokenizer.max_token_bytes
                                  if router.tokenizer is not None else None)
        interceptors: list[grpc.aio.ServerInterceptor] = [RequestGuard(limit, max_len)]
        if security.token is not None:
            interceptors.insert(0, TokenAuth(security.token))
        # NOTE: gRPC enables SO_REUSEPORT by default, which lets a second `orch up` bind the
        # same port and silently share clients with this one: only router replicas set it
        # (check_ports_free refuses a port another `orch up` listens on). gRPC's receive limit stays
        # above the edge's, so the edge (INVALID_ARGUMENT), not gRPC (RESOURCE_EXHAUSTED),
        # refuses what the model cannot use.
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", int(reuse_port)),
            ("grpc.max_receive_message_length", max(max_message_bytes, limit + 1))])
        pb_grpc.add_OrchServicer_to_server(OrchServicer(router, board, peers), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        services = [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME]
        if admin is not None:  # NOTE: the Admin servicer (orchestrator/api/admin.py)
            pb_grpc.add_AdminServicer_to_server(admin, self.server)
            services.append(pb.DESCRIPTOR.services_by_name["Admin"].full_name)
        reflection.enable_server_reflection(tuple(services), self.server)
        self.address = f"{host}:{port}"
        self.port = 0

    @property
    def serving(self) -> bool:
        """What the health service says now: True while serving and every role has a
        healthy instance."""
        return bool(self._serving)

    async def start(self) -> int:
        """Bind, start the router and the server, report SERVING; returns the bound port.

        Raises:
            PortInUseError: the address could not be bound (message says what to do).
        """
        try:
            if self.security.tls_key_pair is None:
                self.port = self.server.add_insecure_port(self.address)
            else:
                creds = grpc.ssl_server_credentials([self.security.tls_key_pair])
                self.port = self.server.add_secure_port(self.address, creds)
        except RuntimeError as exc:
            raise PortInUseError(f"cannot listen on {self.address} ({exc}): pick a free "
                                 "router.port or stop what uses it") from None
        self.router.start()
        self.monitor.add_listener(self._on_health)
        self.monitor.start()
        await self.server.start()
        self._serving = not self.monitor.roles_without_healthy()
        await self._publish(self._serving)
        return self.port

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING, drain the router (bounded by ``grace_s``), stop the health monitor,
        then stop the server."""
        self.monitor.remove_listener(self._on_health)
        if self._health_updates:
            await asyncio.wait(self._health_updates, timeout=grace_s)
        self._serving = False
        await self._publish(False)
        await self.router.stop(drain_timeout_s=grace_s)
        await self.monitor.stop()
        await self.server.stop(grace_s)

    def _on_health(self, changed: InstanceHealth) -> None:
        """Monitor listener: NOT_SERVING while some role has no healthy instance."""
        missing = self.monitor.roles_without_healthy()
        if (not missing) == self._serving:
            return
        if missing:
            log.warning("no healthy %s instance: gRPC health NOT_SERVING until one is back",
                        " or ".join(missing))
        self._serving = not missing
        # NOTE: updates run in creation order, so the last one wins.
        task = asyncio.create_task(self._publish(self._serving))
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _publish(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

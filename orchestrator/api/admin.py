"""The ``orch.v1.Admin`` gRPC service: live scaling (docs/scaling.md).

Served beside ``Orch`` on the router's port, behind the same token and TLS
(``orchestrator.api.interceptors``). Each RPC maps onto the
:class:`~orchestrator.deploy.scaling.Scaler`; a refusal (:class:`ScaleError`) is
FAILED_PRECONDITION, a malformed request INVALID_ARGUMENT, both with what to do.
"""

from __future__ import annotations

import logging

import grpc

from orchestrator.api.rpc import orch_pb2 as pb
from orchestrator.api.rpc import orch_pb2_grpc as pb_grpc
from orchestrator.deploy.scaling import ScaleError, Scaler, ScaleResult

log = logging.getLogger(__name__)
ADMIN_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name  # "orch.v1.Admin"


class AdminServicer(pb_grpc.AdminServicer):
    """Maps the Admin RPCs onto a :class:`Scaler` (on the router's event loop)."""

    def __init__(self, scaler: Scaler) -> None:
        self.scaler = scaler

    async def Scale(self, request: pb.ScaleRequest,
                    context: grpc.aio.ServicerContext) -> pb.ScaleResponse:
        if not request.counts:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "counts is empty: name each role to scale, e.g. decode: 2")
        return await self._run(context, self.scaler.scale(dict(request.counts)))

    async def AddInstance(self, request: pb.AddInstanceRequest,
                          context: grpc.aio.ServicerContext) -> pb.ScaleResponse:
        async def add() -> ScaleResult:
            return ScaleResult(added=(await self.scaler.add(request.role),))
        if request.role not in self.scaler.counts():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"role {request.role!r}: use one of "
                                f"{sorted(self.scaler.counts())}")
        return await self._run(context, add())

    async def RemoveInstance(self, request: pb.RemoveInstanceRequest,
                             context: grpc.aio.ServicerContext) -> pb.ScaleResponse:
        async def remove() -> ScaleResult:
            moved = await self.scaler.remove(request.name)
            return ScaleResult(removed=(request.name,), moved_requests=moved)
        return await self._run(context, remove())

    async def _run(self, context: grpc.aio.ServicerContext, work) -> pb.ScaleResponse:
        try:
            result = await work
        except ScaleError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:  # noqa: BLE001 -- a bug must still answer clearly
            if isinstance(exc, grpc.aio.AbortError):
                raise
            log.exception("scaling failed")
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"scaling failed: {type(exc).__name__}: {exc}; see router log")
        return pb.ScaleResponse(added=result.added, removed=result.removed,
                                moved_requests=result.moved_requests,
                                counts=self.scaler.counts())

"""gRPC server interceptors at the router's edge: bearer-token auth and unparseable requests.

Both work on the method handler gRPC looks up for a call, before any request byte is parsed:

- :class:`TokenAuth` answers UNAUTHENTICATED unless the call's metadata carries
  ``authorization: Bearer <token>`` (compared in constant time). The gRPC health service stays
  open (load balancers probe it without a token); it says only SERVING or NOT_SERVING.
- :class:`RequestGuard` swaps the handler's deserializer for one that never raises: a request
  over the size limit, not valid protobuf, or with a string field that is not UTF-8 becomes
  :class:`Unparsed`, and the wrapped handler answers it INVALID_ARGUMENT with one debug log
  line. (grpc.aio would answer UNKNOWN and log a traceback per request.)

Only unary-request handlers that are coroutines or async generators are guarded (every handler
OrchServer serves); others pass through unchanged.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from orchestrator.router.limits import check_request_size, largest_field
from orchestrator.router.request import RequestError
from orchestrator.api.security import bearer_matches

log = logging.getLogger(__name__)
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
_HANDLER_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class TokenAuth(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every call but the health service.

    Args:
        token: the shared secret (printable ASCII, no spaces; see ``orchestrator.api.security``).
    """

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        presented = next((value for key, value in details.invocation_metadata or ()
                          if key == "authorization"), None)
        if isinstance(presented, str) and bearer_matches(presented, self._token):
            return handler
        why = "no bearer token" if presented is None else "wrong bearer token"
        log.debug("refused %s: %s", details.method, why)
        return _deny(handler, f"{why}: send gRPC metadata 'authorization: Bearer <token>' "
                              "(orch generate/status: --token-file FILE or $ORCH_TOKEN)")


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that reads no request and answers UNAUTHENTICATED."""
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = _HANDLER_MAKERS[(handler.request_streaming, handler.response_streaming)]
    return make(deny, request_deserializer=lambda raw: None)


@dataclass(frozen=True)
class Unparsed:
    """Handed to a guarded handler instead of a request that could not be parsed."""

    error: RequestError


class RequestGuard(grpc.aio.ServerInterceptor):
    """Turns oversized and malformed requests into INVALID_ARGUMENT (see module docstring).

    Args:
        limit_bytes: largest serialized request accepted (``limits.max_request_bytes``).
        max_model_len: named in the over-size message.
    """

    def __init__(self, limit_bytes: int, max_model_len: int) -> None:
        self.limit_bytes = limit_bytes
        self.max_model_len = max_model_len
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        guarded = self._guarded.get(details.method)
        if guarded is None:
            guarded = self._guarded[details.method] = self._guard(handler, details.method)
        return guarded

    def _guard(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        field = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, field)
        if inspect.isasyncgenfunction(behavior):
            wrapped = _guard_async_gen(behavior, method)
        elif inspect.iscoroutinefunction(behavior):
            wrapped = _guard_coroutine(behavior, method)
        else:
            return handler
        make = _HANDLER_MAKERS[(False, handler.response_streaming)]
        return make(wrapped, request_deserializer=self._parser(handler.request_deserializer),
                    response_serializer=handler.response_serializer)

    def _parser(self, deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
        """``deserialize`` that returns :class:`Unparsed` instead of raising; a request over
        the limit is refused naming its largest field (never parsed)."""
        message = getattr(deserialize, "__self__", None)  # NOTE: a proto class's FromString
        fields = message.DESCRIPTOR.fields_by_number if message is not None else {}

        def parse(raw: bytes) -> Any:
            try:
                if len(raw) > self.limit_bytes:
                    field = fields.get(largest_field(raw))
                    check_request_size(len(raw), self.limit_bytes, self.max_model_len,
                                       field.name if field is not None else None)
                return deserialize(raw) if deserialize is not None else raw
            except RequestError as exc:
                return Unparsed(exc)
            except DecodeError as exc:
                return Unparsed(RequestError(
                    "INVALID_ARGUMENT", f"request of {len(raw)} bytes cannot be parsed ({exc}): "
                    "build it from proto/orch.proto (string fields must be UTF-8)"))
        return parse


async def _refuse(method: str, request: Unparsed, context: grpc.aio.ServicerContext) -> None:
    log.debug("refused %s from %s: %s", method, context.peer(), request.error.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error.message)


def _guard_coroutine(behavior: Callable, method: str) -> Callable:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Unparsed):
            await _refuse(method, request, context)
        return await behavior(request, context)
    return guarded


def _guard_async_gen(behavior: Callable, method: str) -> Callable:
    async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Unparsed):
            await _refuse(method, request, context)
        responses = behavior(request, context)
        try:
            async for response in responses:
                yield response
        finally:
            # NOTE: closes the servicer's generator now (its cleanup aborts the request),
            # not whenever the garbage collector finds it.
            await responses.aclose()
    return guarded

"""The OpenAI-compatible HTTP API (a Starlette ASGI app) over the router gRPC serves.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true``: server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``. Every error is
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` with ``code`` the gRPC
status name; the message is the one gRPC gives. Status codes: see :data:`HTTP_STATUS`.

A client that goes away ends its request on every instance, whether it waits for a whole
body, for the first streamed token or mid-stream (the router's stream is closed, which aborts
the request, as a gRPC cancel does).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from orchestrator.api.http import sse
from orchestrator.api.http.chat_template import ChatTemplate
from orchestrator.api.http.generation import Generation, Piece, start_generation
from orchestrator.api.http.off_loop import MAX_CHAT_MESSAGES, OffLoop, parse_body
from orchestrator.api.http.openai_schema import (ChatCompletionRequest, CompletionRequest,
                                             GenerationRequest, error_body, model_list, now)
from orchestrator.api.http.responses import CHAT, COMPLETION, Shape
from orchestrator.router.limits import check_request_size, max_request_bytes
from orchestrator.router.request import RequestError
from orchestrator.router.router import Router
from orchestrator.api.security import bearer_matches

T = TypeVar("T")
BODY_TIMEOUT_S = 30.0  # seconds for a whole request body to arrive
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404,
               "ALREADY_EXISTS": 409, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
               "INTERNAL": 500, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
              404: "invalid_request_error", 429: "rate_limit_error"}
# NOTE: JSON may escape one character of the prompt into up to 6 bytes (\u0001): a body
# this many times the gRPC edge's limit still holds every prompt the model can use.
JSON_ESCAPE_FACTOR = 6
CLIENT_GONE = 499  # nginx's "client closed request": nobody reads it


class OpenAIApp:
    """Handlers over one router.

    Args:
        router: the router gRPC also serves (started and stopped by its owner).
        chat_template: the checkpoint's template (None: chat completions answer 400).
        token: bearer token every route but /health needs (None: no auth).
        ready: True while the router should get traffic (/health says 200, else 503).
        retry_after: seconds a client should wait after a 503 (the health monitor's
            ``retry_after_s``), sent as ``Retry-After`` on every 503.
    """

    def __init__(self, router: Router, chat_template: ChatTemplate | None,
                 token: str | None, ready: Callable[[], bool],
                 retry_after: Callable[[], float] = lambda: 1.0) -> None:
        self.router, self.chat_template, self.ready = router, chat_template, ready
        self.retry_after = retry_after
        self.model = router.model.name
        self._token = token
        max_len = router.model.max_model_len
        self.max_model_len = max_len
        self.body_limit = JSON_ESCAPE_FACTOR * max_request_bytes(
            max_len, router.tokenizer.max_token_bytes if router.tokenizer else None)
        self.max_messages = min(MAX_CHAT_MESSAGES, max_len)
        self.off_loop = OffLoop()
        self.created = now()

    def asgi(self) -> Starlette:
        """The ASGI app."""
        return Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ], exception_handlers={RequestError: self._request_error, HTTPException: _http_error,
                               Exception: _bug})

    async def health(self, request: Request) -> Response:
        ok = self.ready()
        return JSONResponse({"status": "serving" if ok else "not serving"},
                            status_code=200 if ok else 503,
                            headers=None if ok else self._retry_header())

    def _retry_header(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after())))}

    async def _request_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestError)
        status = HTTP_STATUS.get(exc.code, 500)
        return JSONResponse(_error_json(exc), status_code=status,
                            headers=self._retry_header() if status == 503 else None)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse(model_list(self.model, self.created))

    async def completions(self, request: Request) -> Response:
        req = await self._parse(request, CompletionRequest)
        text, ids = req.prompt_parts()
        gen = await start_generation(self.router, text, ids, req, req.max_tokens)
        return await self._respond(request, gen, req, COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        if self.chat_template is None:
            raise RequestError("INVALID_ARGUMENT", f"{self.model} has no chat template "
                                                   "(tokenizer_config.json chat_template): use "
                                                   "/v1/completions")
        text = await self.off_loop.run(_render, self.chat_template, req.messages)
        gen = await start_generation(self.router, text, None, req, req.token_budget)
        return await self._respond(request, gen, req, CHAT)

    async def _parse(self, request: Request, kind: type[T]) -> T:
        """Auth, size, message count, JSON, schema, model name, supported fields (in that
        order; parsing off the loop, :mod:`orchestrator.api.http.off_loop`)."""
        self._authorize(request)
        body = await _read_body(request, self.body_limit, self.max_model_len)
        req = await self.off_loop.run(parse_body, body, kind, self.max_messages)
        if req.model != self.model:
            raise RequestError("NOT_FOUND", f"model '{req.model}' is not served here: use "
                                            f"'{self.model}' (GET /v1/models lists it)")
        req.check_supported()
        return req

    def _authorize(self, request: Request) -> None:
        if self._token is None:
            return
        presented = request.headers.get("authorization")
        if bearer_matches(presented, self._token):
            return
        why = "no bearer token" if presented is None else "wrong bearer token"
        raise RequestError("UNAUTHENTICATED", f"{why}: send the header 'Authorization: Bearer "
                                              "<token>' (the OpenAI client's api_key)")

    async def _respond(self, request: Request, gen: Generation, req: GenerationRequest,
                       shape: Shape) -> Response:
        created, pieces = now(), gen.pieces()
        if not req.stream:
            whole = await _unless_disconnected(request, _collect(pieces))
            if whole is None:
                return Response(status_code=CLIENT_GONE)
            text, finish = whole
            return JSONResponse(shape.whole(gen.request_id, created, self.model, text, finish,
                                            gen.prompt_tokens, gen.completion_tokens,
                                            gen.cached_tokens))
        # NOTE: the first piece is awaited before the 200 goes out, so a refused request
        # (bad input, overload) still gets its HTTP status.
        first = await _unless_disconnected(request, anext(pieces))
        if first is None:
            return Response(status_code=CLIENT_GONE)
        return StreamingResponse(self._events(gen, shape, created, first, pieces,
                                              req.include_usage), media_type=sse.MEDIA_TYPE)

    async def _events(self, gen: Generation, shape: Shape, created: int, first: Piece,
                      rest: AsyncIterator[Piece], include_usage: bool) -> AsyncIterator[bytes]:
        rid, piece, is_first = gen.request_id, first, True
        try:
            while True:
                yield sse.event(shape.chunk(rid, created, self.model, piece.text,
                                            piece.finish_reason, is_first))
                if piece.finish_reason is not None:
                    break
                piece, is_first = await anext(rest), False
            if include_usage:
                yield sse.event(shape.usage_chunk(rid, created, self.model, gen.prompt_tokens,
                                                  gen.completion_tokens, gen.cached_tokens))
        except RequestError as exc:
            yield sse.event(_error_json(exc))
        finally:
            await rest.aclose()
        yield sse.DONE


def _render(template: ChatTemplate, messages: list) -> str:
    return template.render([m.for_template() for m in messages])


async def _collect(pieces: AsyncIterator[Piece]) -> tuple[str, str | None]:
    text, finish = [], None
    async for piece in pieces:
        text.append(piece.text)
        finish = piece.finish_reason
    return "".join(text), finish


async def _read_body(request: Request, limit: int, max_model_len: int) -> bytes:
    """The body, refused (gRPC's size message) once it passes ``limit`` bytes, or when it
    has not all arrived within :data:`BODY_TIMEOUT_S` (uvicorn itself never times a body out).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit():
        check_request_size(int(declared), limit, max_model_len)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                check_request_size(size, limit, max_model_len)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError("DEADLINE_EXCEEDED", f"the request body did not arrive within "
                                                f"{BODY_TIMEOUT_S:g} s ({size} bytes came): "
                                                "send the whole body at once") from None
    return b"".join(chunks)


async def _until_disconnect(request: Request) -> None:
    """Returns when the client closed the connection (the body was already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None when the client went away first (``work`` is cancelled:
    the router's stream inside it closes and aborts the request)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return None if task.cancelled() else task.result()


def _error_json(exc: RequestError) -> dict[str, Any]:
    status = HTTP_STATUS.get(exc.code, 500)
    code = "model_not_found" if exc.code == "NOT_FOUND" else exc.code
    return error_body(exc.message, ERROR_TYPE.get(status, "server_error"), code,
                      "model" if exc.code == "NOT_FOUND" else None)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse(error_body(f"{exc.detail}: {request.method} {request.url.path} (orch "
                                   "serves /v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health)", "invalid_request_error", str(exc.status_code)),
                        status_code=exc.status_code)


async def _bug(request: Request, exc: Exception) -> Response:
    """A bug still answers in OpenAI's shape, with gRPC's INTERNAL message (uvicorn logs the
    traceback)."""
    return JSONResponse(error_body(f"router error: {type(exc).__name__}: {exc}; see router "
                                   "log", "server_error", "INTERNAL"), status_code=500)

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
from orchestrator.api.http.chat_request import plan_chat
from orchestrator.api.http.chat_template import ChatTemplate
from orchestrator.api.http.choices import Choice
from orchestrator.api.http.deepseek_output import OutputStream
from orchestrator.api.http.generation import Generation, Piece, start_generation
from orchestrator.api.http.off_loop import MAX_CHAT_MESSAGES, OffLoop, parse_body
from orchestrator.api.http.openai_schema import (ChatCompletionRequest, CompletionRequest,
                                             GenerationRequest, error_body, model_list, now)
from orchestrator.api.http.responses import CHAT, COMPLETION, Shape
from orchestrator.router.fan_out import merge_streams
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
        gens = await start_generation(self.router, text, ids, req, req.max_tokens)
        return await self._respond(request, gens, req, COMPLETION, lambda: None)

    async def chat_completions(self, request: Request) -> Response:
        req = await self._parse(request, ChatCompletionRequest)
        if self.chat_template is None:
            raise RequestError("INVALID_ARGUMENT", f"{self.model} has no chat template "
                                                   "(tokenizer_config.json chat_template): use "
                                                   "/v1/completions")
        plan = await self.off_loop.run(plan_chat, self.chat_template, req, self._token_id)
        gens = await start_generation(self.router, plan.prompt, None, req, req.token_budget,
                                      plan.grammar)
        return await self._respond(request, gens, req, CHAT,
                                   lambda: OutputStream(plan.in_reasoning, plan.parse_tools))

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

    async def _respond(self, request: Request, gens: list[Generation],
                       req: GenerationRequest, shape: Shape,
                       parser: Callable[[], OutputStream | None]) -> Response:
        created = now()
        choices = [Choice(i, shape.chat, self._token_text, parser())
                   for i in range(len(gens))]
        lp = req.top_logprobs_count is not None
        if not req.stream:
            done = await _unless_disconnected(request, asyncio.gather(
                *(_collect(g.pieces(), c) for g, c in zip(gens, choices))))
            if done is None:
                return Response(status_code=CLIENT_GONE)
            return JSONResponse(shape.whole(gens[0].response_id, created, self.model,
                                            [c.whole(lp) for c in choices],
                                            gens[0].prompt_tokens,
                                            sum(g.completion_tokens for g in gens),
                                            gens[0].cached_tokens))
        streams = [g.pieces() for g in gens]
        # NOTE: each choice's first piece is awaited before the 200 goes out, so a refused
        # request (bad input, overload) still gets its HTTP status.
        firsts = await _unless_disconnected(request, asyncio.gather(
            *(anext(s) for s in streams)))
        if firsts is None:
            for s in streams:
                await s.aclose()
            return Response(status_code=CLIENT_GONE)
        return StreamingResponse(self._events(gens, shape, created, choices, firsts, streams,
                                              req), media_type=sse.MEDIA_TYPE)

    async def _events(self, gens: list[Generation], shape: Shape, created: int,
                      choices: list[Choice], firsts: list[Piece],
                      streams: list[AsyncIterator[Piece]],
                      req: GenerationRequest) -> AsyncIterator[bytes]:
        rid, lp = gens[0].response_id, req.top_logprobs_count is not None
        merged = merge_streams([_then(f, s) for f, s in zip(firsts, streams)])
        try:
            async for index, piece in merged:
                for choice in choices[index].chunks(piece, lp):
                    yield sse.event(shape.chunk(rid, created, self.model, choice))
            if req.include_usage:
                yield sse.event(shape.usage_chunk(rid, created, self.model,
                                                  gens[0].prompt_tokens,
                                                  sum(g.completion_tokens for g in gens),
                                                  gens[0].cached_tokens))
        except RequestError as exc:
            yield sse.event(_error_json(exc))
        finally:
            await merged.aclose()
            for s in streams:
                await s.aclose()
        yield sse.DONE

    def _token_id(self, text: str) -> int | None:
        tok = self.router.tokenizer
        return tok.token_id(text) if tok is not None else None

    def _token_text(self, token_id: int) -> str:
        tok = self.router.tokenizer
        return tok.token_text(token_id) if tok is not None else f"<{token_id}>"


async def _then(first: Piece, stream: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """``first`` (already awaited), then the rest of ``stream``."""
    yield first
    if first.finish_reason is None:
        async for piece in stream:
            yield piece


async def _collect(pieces: AsyncIterator[Piece], choice: Choice) -> None:
    async for piece in pieces:
        choice.add(piece)


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
    try:
        return task.result()
    except asyncio.CancelledError:
        # NOTE: a cancelled gather() is not ``cancelled()``: its result raises CancelledError
        return None


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

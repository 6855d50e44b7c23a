"""The HTTP server closes connections that hold no request in progress (a newcomer's attack
on `orch up`: a connection sending nothing, or half its headers, stayed open after 40 s, each
holding a file descriptor of the router process), and never cuts a request being served.
A bare Starlette app on the real HttpServer; the bound is shortened to 0.5 s."""

from __future__ import annotations

import asyncio
import time

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from orchestrator.api.http.server import HttpServer

IDLE_S = 0.5
CLOSED_WITHIN_S = 5.0  # generous for a loaded machine; the old server never closed them


async def _slow(request) -> PlainTextResponse:
    await asyncio.sleep(3 * IDLE_S)
    return PlainTextResponse("done")


async def _closed_after(reader: asyncio.StreamReader) -> tuple[bytes, float]:
    """Everything the server sent until it closed, and when (s); raises TimeoutError when it
    kept the connection open past CLOSED_WITHIN_S."""
    start, data = time.monotonic(), b""
    async with asyncio.timeout(CLOSED_WITHIN_S):
        while chunk := await reader.read(65536):
            data += chunk
    return data, time.monotonic() - start


async def _scenario() -> None:
    app = Starlette(routes=[Route("/slow", _slow)])
    server = HttpServer(app, "127.0.0.1", 0, grace_s=1.0, idle_s=IDLE_S)
    port = await server.start()
    try:
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        (_, silent), (_, half), (_, kept), (_, busy) = conns
        half.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never end
        kept.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")  # then half of a second one
        busy.write(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head = await asyncio.wait_for(conns[2][0].readuntil(b"done"), CLOSED_WITHIN_S)
        kept.write(b"GET /slow HT")
        results = await asyncio.gather(*(_closed_after(r) for r, _ in conns))
        for name, (data, _) in zip(("silent", "half headers"), results):
            assert data == b"", f"{name}: {data!r}"
        assert b"200 OK" in head and results[2][0] == b"", results[2]
        # NOTE: served for 3 x IDLE_S: a request in progress is never cut
        assert results[3][0].startswith(b"HTTP/1.1 200") and results[3][0].endswith(b"done")
        for w in (silent, half, kept, busy):
            w.close()
    finally:
        await server.stop()


def test_connections_without_a_request_are_closed_and_requests_in_progress_are_not():
    asyncio.run(_scenario())

"""The HTTP server's connections send each write at once (TCP_NODELAY): without it, Nagle held
a stream's first event behind the unacknowledged response headers until the client's delayed
ACK (~40 ms on Linux), on every kept-alive request after the first (issue 36: HTTP TTFT 70 ms
against gRPC's 25 ms on one server). Real uvicorn + router over fake leaders."""

from __future__ import annotations

import json
import socket
import statistics
import time

from tests.orchestrator.harness import MODEL, TOKENIZER
from tests.orchestrator.test_http_api import HttpHarness

# NOTE: the held event waited >= 40 ms (Linux's minimum delayed ACK); a direct write arrives
# within a ms of its headers, so the median over a few requests stays far below this on a busy box
HELD_BOUND_MS = 20.0


def _request(port: int, prompt_ids: list[int]) -> bytes:
    body = json.dumps({"model": MODEL.name, "prompt": prompt_ids, "max_tokens": 3,
                       "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def _headers_to_first_event_ms(sock: socket.socket, request: bytes) -> float:
    """Milliseconds from the response headers' arrival to the first ``data:`` event's; reads
    the response to its end (chunked ``0`` terminator) so the connection can be reused."""
    sock.sendall(request)
    buf, t_head, t_event = b"", None, None
    deadline = time.monotonic() + 10
    while not buf.endswith(b"\r\n0\r\n\r\n"):
        assert time.monotonic() < deadline, f"no complete response in 10 s: {buf[-200:]!r}"
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-response: {buf[-200:]!r}"
        buf += chunk
        now = time.perf_counter()
        if t_head is None and b"\r\n\r\n" in buf:
            t_head = now
        if t_event is None and b"data: " in buf:
            t_event = now
    assert buf.startswith(b"HTTP/1.1 200"), buf[:200]
    return (t_event - t_head) * 1e3


def test_accepted_connections_have_nodelay_and_first_events_are_not_held():
    h = HttpHarness(request_timeout_s=30)
    try:
        port = int(h.url.rsplit(":", 1)[1].split("/")[0])
        ids = TOKENIZER.encode("Hello there, how are you")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            gaps = [_headers_to_first_event_ms(sock, _request(port, ids)) for _ in range(5)]

            async def nodelay_flags() -> list[int]:
                return [c.transport.get_extra_info("socket").getsockopt(
                            socket.IPPROTO_TCP, socket.TCP_NODELAY)
                        for c in h.http.server.server_state.connections]
            flags = h.run(nodelay_flags())
        assert flags and all(flags), f"server-side TCP_NODELAY per connection: {flags}"
        # NOTE: the first request on a fresh connection is ACKed at once (quick-ACK mode);
        # the kept-alive ones after it are where Nagle held the first event
        assert statistics.median(gaps[1:]) < HELD_BOUND_MS, f"headers -> first event ms: {gaps}"
    finally:
        h.close()

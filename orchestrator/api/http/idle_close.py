"""uvicorn's h11 protocol with a bound on the time a connection may hold no request.

uvicorn times a connection out only between two requests after a response
(``timeout_keep_alive``), and its ``data_received`` cancels that timer at the first byte. A
connection that sends nothing, sends half a request line or half its headers, or finishes
uploading the rest of a body after an early error reply, therefore stayed open for ever
(measured: still open after 40 s on ``orch up``), each holding a file descriptor of the
router process (the one gRPC, Ray and the KV pairs use too): enough of them exhaust it.

Here a timer of :data:`HEADER_TIMEOUT_S` starts when the connection opens and again after
each response; when it fires and no request is being served (none started, or the last one's
response is complete), the connection is closed. A request in progress (its body arriving:
``app.BODY_TIMEOUT_S`` bounds that; its response streaming) is never cut by it. NOTE: under
TLS ``connection_made`` comes after the handshake, so a connection that never completes one is
bounded by asyncio's handshake timeout (60 s), not by this timer.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # seconds a connection may stay open without a request in progress


class IdleClosingH11Protocol(H11Protocol):
    """:class:`H11Protocol` closing a connection that holds no request in progress for
    :attr:`header_timeout_s` seconds (module docstring)."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._arm_idle_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def _arm_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self.loop.call_later(self.header_timeout_s, self._idle_timeout)

    def _serving(self) -> bool:
        """A request is in progress: its headers came and its response is not complete."""
        return self.cycle is not None and not self.cycle.response_complete

    def _idle_timeout(self) -> None:
        self._idle_timer = None
        if self._serving() or self.transport.is_closing():
            return  # NOTE: on_response_complete arms it again
        if self.conn.our_state not in (h11.ERROR, h11.CLOSED, h11.MUST_CLOSE):
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
        self.transport.close()

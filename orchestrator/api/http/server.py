"""uvicorn serving the OpenAI app inside ``orch up``'s event loop, beside gRPC.

The socket is bound here (a taken port is a :class:`PortInUseError` naming
``router.http_port``); uvicorn's signal handling is off (``orch up`` owns SIGINT/SIGTERM) and
its logging config left alone. TLS when ``router.tls`` is set (gRPC's PEM files).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path

import uvicorn

from orchestrator.api.http.idle_close import HEADER_TIMEOUT_S, IdleClosingH11Protocol
from orchestrator.config.sections import TLSSection
from orchestrator.api.server import PortInUseError

log = logging.getLogger(__name__)
STOP_SLACK_S = 5.0  # beyond the graceful bound, for uvicorn's own shutdown steps


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers (they would replace orch up's)."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


class HttpServer:
    """One uvicorn server for ASGI ``app`` on ``host:port`` (port 0: any free one).

    ``tls``: PEM certificate and key files, or None; ``grace_s``: seconds :meth:`stop` lets
    running requests finish before cancelling them; ``reuse_port``: share the port with the
    other router replicas (SO_REUSEPORT; every one must set it); ``idle_s``: seconds a
    connection may stay open with no request in progress (none sent yet, half a request line or
    headers, after a response) before it is closed (:mod:`orchestrator.api.http.idle_close`).
    """

    def __init__(self, app, host: str, port: int, tls: TLSSection | None = None,
                 grace_s: float = 30.0, reuse_port: bool = False,
                 idle_s: float = HEADER_TIMEOUT_S) -> None:
        ssl = {} if tls is None else {
            "ssl_certfile": str(Path(tls.cert_file).expanduser()),
            "ssl_keyfile": str(Path(tls.key_file).expanduser())}
        protocol = type("IdleClosingH11", (IdleClosingH11Protocol,), {"header_timeout_s": idle_s})
        self.config = uvicorn.Config(app, host=host, port=port, lifespan="off",
                                     log_config=None, access_log=False, http=protocol,
                                     timeout_graceful_shutdown=grace_s, **ssl)
        self.host, self.port, self.grace_s = host, port, grace_s
        self.reuse_port = reuse_port
        self.server = _EmbeddedServer(self.config)
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and serve in a task of the running loop; returns the bound port.

        Raises:
            PortInUseError: the port is taken (the message names router.http_port).
        """
        self.config.load()  # NOTE: TLS files are read here, so a bad one fails start()
        # NOTE: proto IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY on accepted
        # connections only when the listening socket says TCP. Without it Nagle held each
        # stream's first event behind the unacknowledged response headers until the client's
        # delayed ACK (~40 ms on Linux) on every kept-alive request after the first.
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET,
                             socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise PortInUseError(f"router.http_port {self.port} on {self.host} is not free "
                                 f"({exc}): stop what uses it or pick another "
                                 "router.http_port") from None
        sock.listen(self.config.backlog)  # NOTE: clients queue from here on, before serve
        self.port = sock.getsockname()[1]
        self._task = asyncio.create_task(self.server.serve(sockets=[sock]), name="http-server")
        self._task.add_done_callback(_log_failure)
        return self.port

    async def stop(self) -> None:
        """Stop accepting, let running requests end (bounded by ``grace_s``, then cancelled),
        then return."""
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.grace_s + STOP_SLACK_S)
        except asyncio.TimeoutError:
            log.warning("HTTP server did not stop within %.0f s: cancelling it",
                        self.grace_s + STOP_SLACK_S)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("HTTP server failed: %r", task.exception())

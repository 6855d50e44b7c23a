"""The leader's TCP socket primitives, shared by its event stream (rank/event_stream.py), its
call server (rank/call_server.py) and its step channel (rank/step_channel.py): a bounded
exact read, a shutdown that wakes a blocked thread, and an accept loop that outlives a
failed accept."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

ACCEPT_RETRY_S = 0.1  # a failed accept() (e.g. out of descriptors) is tried again this often


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from blocking ``sock``; with ``deadline`` (``time.monotonic()``)
    all of them by then (else each ``recv`` within the socket's own timeout: a peer that
    sends a byte at a time could stretch the whole past it).

    Raises:
        ConnectionError: the peer closed first. TimeoutError: past ``deadline``. OSError: the
            socket failed or timed out.
    """
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(buf)} of {n} bytes came in time")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed by the peer")
        buf += chunk
    return bytes(buf)


def shut(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways (wakes a thread blocked on it); errors ignored."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass



def accept_each(name: str, listener: socket.socket, closed: Callable[[], bool],
                take: Callable[[socket.socket], None]) -> None:
    """Hand each connection ``listener`` accepts to ``take`` (which starts its thread) until
    ``closed()``; the owner sets that, then closes ``listener`` to end a waiting accept.

    A failed ``accept()`` while open (EMFILE: the process is out of descriptors for a moment;
    the connection stays queued) or a ``take`` that fails (its connection closed; a thread
    that did not start) is tried again every :data:`ACCEPT_RETRY_S`: returning would leave
    the listener up with nobody taking its connections, so a router's next connection (after
    any break) would wait out its bound. One warning per run of failures.
    """
    failing = False
    while not closed():
        conn = None
        try:
            conn, _ = listener.accept()
            take(conn)
            failing = False
        except (OSError, RuntimeError) as exc:  # NOTE: RuntimeError: no thread started
            if conn is not None:
                conn.close()
            if closed():
                return
            log.log(logging.DEBUG if failing else logging.WARNING,
                    "%s: could not take a connection (%s: %s); retrying every %g s",
                    name, type(exc).__name__, exc, ACCEPT_RETRY_S)
            failing = True
            time.sleep(ACCEPT_RETRY_S)

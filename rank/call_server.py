"""The leader's end of the router's leader calls over TCP (``router.leader_calls: socket``).

One Ray actor call costs the router ~1 ms of CPU and 2.6-3.5 ms round trip here; the same
message over a plain socket 0.05-0.11 ms and 0.3-0.5 ms (docs/performance.md, "Leader calls
over a socket"). So a router may send its :data:`~rank.messages.LeaderRequest`\\ s here
instead: :meth:`CallServer.open` (a Ray call, ``Rank.open_calls``) listens on the instance's
``bind_host`` and hands out (host, port, token); the router connects, proves the token, and
sends calls on that one connection. Each call runs on a bounded pool of threads (a handler may
block on the step lock, as a Ray actor thread does), never on the connection's reader thread,
and its answer goes back on the same connection, in completion order.

Wire: every frame is an 8-byte big-endian length and a body.
- hello (router -> leader, first frame): the 16-byte token.
- call (router -> leader): 8-byte call id, then ``pickle(request)``.
- answer (leader -> router): 8-byte call id, 1 byte status (:data:`OK` or :data:`RAISED`), then
  ``pickle(result)`` or, raised, ``pickle((exception or None, first line of it))`` (None when
  the exception does not pickle: the router then has the line only).

NOTE: pickle is read only from a peer that proved the token, which came over Ray: the same
trust as Ray's own calls, whose arguments are pickled too. The router reads the leader's
pickles from the address Ray gave it, as Ray's own answers.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.error_text import first_line
from rank.sockets import accept_each, recv_exact, shut

log = logging.getLogger(__name__)

LEN = struct.Struct("!Q")  # every frame's length, and a call's id
OK, RAISED = 0, 1  # an answer's status byte
TOKEN_BYTES = 16
# NOTE: as many handler threads as a rank actor has for its Ray calls
# (orchestrator/deploy/rank_actors.py ACTOR_CONCURRENCY): calls may wait for the step lock.
CALL_THREADS = 16
HELLO_TIMEOUT_S = 5.0  # a connection proves its token within this, else it is closed
SEND_TIMEOUT_S = 30.0  # one frame's send or receive, once started; past it the connection ends
IDLE_CHECK_S = 1.0  # an idle connection's reader looks at whether the server closed this often
MAX_FRAME_BYTES = 1 << 30


def frame(body: bytes) -> bytes:
    """``body`` with its 8-byte length in front."""
    return LEN.pack(len(body)) + body


def encode_answer(call_id: int, ok: bool, value: Any) -> bytes:
    """One answer frame: ``value`` is the handler's result (``ok``) or the exception it raised.
    A result that does not pickle becomes the error of it."""
    if ok:
        try:
            return frame(LEN.pack(call_id) + bytes([OK]) + pickle.dumps(value))
        except Exception as exc:  # noqa: BLE001 - the caller gets the reason, not a hang
            value = TypeError(f"the answer does not pickle: {first_line(exc)}")
    try:
        shipped = pickle.dumps((value, first_line(value)))
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its line only
        shipped = pickle.dumps((None, first_line(value)))
    return frame(LEN.pack(call_id) + bytes([RAISED]) + shipped)


class CallServer:
    """Leader end of the router's leader calls (see the module docstring).

    Args:
        name: the instance's name (thread names, logs).
        host: the address to listen on (the instance's ``bind_host``).
        handle: runs one call, ``handle(request) -> answer`` (``Rank.request``); it may block,
            and what it raises goes back to the caller.
        threads: the most calls running at once (more wait for a thread).
    """

    def __init__(self, name: str, host: str, handle: Callable[[Any], Any],
                 threads: int = CALL_THREADS) -> None:
        self.name, self.host, self._handle = name, host, handle
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-calls")
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def open(self) -> tuple[str, int, bytes]:
        """Listen (first call); (host, port, token) for a router to connect with.

        Raises:
            RuntimeError: the server is closed (the rank is shutting down).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the leader call server is closed")
            if self._listener is None:
                self._listener = socket.create_server((self.host, 0), backlog=64)
                self._start(self._accept_loop, f"{self.name}-calls-accept", self._listener)
            port = self._listener.getsockname()[1]
        return self.host, port, self.token

    def break_connections(self) -> None:
        """Close every router connection now (their calls in flight fail there; a router
        connects again with its next call): tests."""
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            shut(conn)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, close every connection (a router's calls in flight fail there),
        drop the calls not yet started, and wait up to ``timeout_s`` for the reader threads;
        a call still running finishes on its thread, its answer dropped."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            conns, threads = list(self._conns), list(self._threads)
        if listener is not None:
            shut(listener)
            listener.close()
        for conn in conns:
            shut(conn)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for thread in threads:
            thread.join(timeout_s)

    def _start(self, target: Callable, name: str, *args: Any) -> None:
        """A daemon thread (caller holds the lock); ended ones are forgotten."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()  # NOTE: before it is kept: close() joins only started threads
        self._threads.append(thread)

    def _accept_loop(self, listener: socket.socket) -> None:
        accept_each(f"{self.name} leader calls", listener, lambda: self._closed, self._take)

    def _take(self, conn: socket.socket) -> None:
        """Serve ``conn`` on a thread of its own (refused once closed).

        Raises:
            RuntimeError: the thread did not start (``conn`` is not kept).
        """
        with self._lock:
            if self._closed:
                conn.close()
                return
            # NOTE: the lock is held: the thread cannot discard ``conn`` before it is kept
            self._start(self._serve, f"{self.name}-calls-in", conn)
            self._conns.add(conn)

    def _serve(self, conn: socket.socket) -> None:
        """One router connection: its hello, then each call frame to the pool."""
        send_lock = threading.Lock()  # NOTE: answers from several pool threads, one at a time
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello_by = time.monotonic() + HELLO_TIMEOUT_S  # NOTE: the whole hello, not per recv
            if not hmac.compare_digest(_recv_body(conn, TOKEN_BYTES, hello_by), self.token):
                raise ConnectionError("wrong token")
            # NOTE: one timeout for the reader and the pool's sends: the reader waits for a
            # frame with poll() (_next_frame), so it never toggles it
            conn.settimeout(SEND_TIMEOUT_S)
            while True:
                body = self._next_frame(conn)
                if body is None:
                    return
                (call_id,) = LEN.unpack_from(body)
                self._pool.submit(self._answer, conn, send_lock, call_id, body[LEN.size:])
        # NOTE: RuntimeError: the pool was shut down (the server closed)
        except (OSError, ValueError, struct.error, RuntimeError) as exc:
            log.debug("%s: a leader call connection ended: %s", self.name, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
            shut(conn)
            conn.close()

    def _next_frame(self, conn: socket.socket) -> bytes | None:
        """The next frame's body; None once the server closed. An idle wait is unbounded
        (the server's close checked every :data:`IDLE_CHECK_S`); a started frame must arrive
        within :data:`SEND_TIMEOUT_S` (the socket's timeout)."""
        # NOTE: poll, not select: a rank process may hold fds past select's 1024
        poller = select.poll()
        poller.register(conn, select.POLLIN)
        while not self._closed:
            if poller.poll(IDLE_CHECK_S * 1000):  # NOTE: readable, or the peer hung up
                return _recv_body(conn, MAX_FRAME_BYTES)
        return None

    def _answer(self, conn: socket.socket, send_lock: threading.Lock, call_id: int,
                payload: bytes) -> None:
        """One call on a pool thread: run it, send its answer (a gone connection: dropped)."""
        try:
            data = encode_answer(call_id, True, self._handle(pickle.loads(payload)))
        except Exception as exc:  # noqa: BLE001 - the caller's error, as over Ray
            data = encode_answer(call_id, False, exc)
        try:
            with send_lock:
                conn.sendall(data)
        except OSError as exc:  # NOTE: the router then fails its calls in flight, reconnects
            log.debug("%s: a leader call's answer was not sent: %s", self.name, exc)
            shut(conn)


def _recv_body(sock: socket.socket, limit: int, deadline: float | None = None) -> bytes:
    """One frame's body (its length first), of at most ``limit`` bytes; by ``deadline``
    (``time.monotonic()``) when given.

    Raises:
        ValueError: a longer frame. ConnectionError: the peer closed. OSError: timed out.
    """
    (n,) = LEN.unpack(recv_exact(sock, LEN.size, deadline))
    if n > limit:
        raise ValueError(f"a frame of {n} bytes (at most {limit})")
    return recv_exact(sock, n, deadline)

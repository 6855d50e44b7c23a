"""The channel between router replicas (``router.replicas``): aborts, health and metrics.

Every replica listens on loopback (:class:`PeerServer`, an ephemeral port) for the other
replicas of the same `orch up`; the first replica (the one holding the health monitor and the
metrics endpoint) is every other one's peer too. Calls (:class:`PeerClient`, one connection,
one call at a time, each bounded):

- ``["abort", request_id]`` -> ``found``: an Abort that reached a replica that does not run the
  request; the one that runs it aborts it as its own (so the client's stream ends "abort").
- ``["probe", instance]`` -> ``why`` (None when it answered) and ``["failure", instance,
  reason]``: a replica's placement asks the first replica's health monitor.
- ``["metrics", method, args]``: a replica's :class:`RouterMetrics` report, applied by the
  first replica's metrics (one ``/metrics`` for all replicas).

Wire: rank/event_stream.py's frames (8-byte length + msgpack); the connection's first frame
is the shared secret (random per `orch up`, handed to the replicas at spawn), compared in
constant time; a wrong one closes the connection.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from rank.event_stream import pack_frame

log = logging.getLogger(__name__)
_LEN = struct.Struct("!Q")
CALL_TIMEOUT_S = 5.0  # one call, connect included
MAX_FRAME_BYTES = 1 << 20
PeerAddress = tuple[str, int]
Op = Callable[..., Any]  # sync or async; its answer must be msgpack-able


async def _read(reader: asyncio.StreamReader) -> Any:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"peer frame of {size} bytes")
    return msgpack.unpackb(await reader.readexactly(size), raw=False)


class PeerServer:
    """Answers the other replicas' calls with ``ops`` (name -> function of the call's args).

    Args:
        ops: e.g. ``{"abort": router.abort}``; an unknown op or a failing one answers
            ``None`` (logged).
        secret: the shared secret every connection must present first.
        host: loopback: replicas of one `orch up` run on one node.
    """

    def __init__(self, ops: dict[str, Op], secret: bytes, host: str = "127.0.0.1") -> None:
        self.ops, self.secret, self.host = ops, secret, host
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> PeerAddress:
        """Listen (call on the replica's loop); returns (host, port)."""
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        return self.host, self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            secret = await asyncio.wait_for(_read(reader), CALL_TIMEOUT_S)
            if not hmac.compare_digest(bytes(secret), self.secret):
                raise ConnectionError("wrong secret")
            while True:
                op, *args = await _read(reader)
                writer.write(pack_frame([await self._answer(op, args)]))
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError,
                TypeError, msgpack.UnpackException) as exc:
            log.debug("a peer connection ended: %s", exc)
        finally:
            writer.close()

    async def _answer(self, op: str, args: list) -> Any:
        fn = self.ops.get(op)
        if fn is None:
            log.warning("peer call %r is not served by this replica", op)
            return None
        try:
            answer = fn(*args)
            return await answer if asyncio.iscoroutine(answer) else answer
        except Exception:  # noqa: BLE001 -- one bad call must not end the channel
            log.exception("peer call %s failed", op)
            return None


class PeerClient:
    """Calls one peer replica's :class:`PeerServer` (on the caller's loop).

    Args:
        address: the peer's (host, port); secret: the shared secret.
    """

    def __init__(self, address: PeerAddress, secret: bytes) -> None:
        self.address, self.secret = tuple(address), secret
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    async def call(self, op: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
        """The peer's answer to ``[op, *args]``.

        Raises:
            ConnectionError: the peer did not answer within ``timeout_s`` or the connection
                failed (the next call connects again).
        """
        async with self._lock:
            try:
                return await asyncio.wait_for(self._call(op, args), timeout_s)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                self.close()
                raise ConnectionError(f"router replica at {self.address[0]}:"
                                      f"{self.address[1]} did not answer {op}: "
                                      f"{type(exc).__name__}: {exc}") from exc

    async def _call(self, op: str, args: tuple) -> Any:
        if self._conn is None:
            reader, writer = await asyncio.open_connection(*self.address)
            writer.write(pack_frame(self.secret))
            self._conn = reader, writer
        reader, writer = self._conn
        writer.write(pack_frame([op, *args]))
        (answer,) = await _read(reader)
        return answer

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


class Peers:
    """The other replicas of this `orch up`: an Abort not found here is asked of each."""

    def __init__(self, clients: list[PeerClient] | None = None) -> None:
        self.clients = list(clients or ())

    async def abort(self, request_id: str) -> bool:
        """Ask every peer to abort ``request_id`` (at once, each bounded); True when one
        runs it. A peer that does not answer counts as not running it (logged)."""
        answers = await asyncio.gather(*(c.call("abort", request_id) for c in self.clients),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                log.warning("abort of %s: %s", request_id, answer)
        return any(answer is True for answer in answers)

    def close(self) -> None:
        for client in self.clients:
            client.close()


class ForwardedMetrics:
    """A replica's :class:`~orchestrator.router.metrics_sink.RouterMetrics`: every report goes to the
    first replica's metrics over ``main`` (in the background, in order; a lost one is logged).
    ``update_instances`` is the first replica's own (its status board)."""

    def __init__(self, main: PeerClient) -> None:
        self.main = main
        self._queue: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None

    def _send(self, method: str, *args: Any) -> None:
        if self._task is None:
            self._queue = asyncio.Queue()
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._queue.put_nowait((method, args))

    async def _run(self) -> None:
        while True:
            method, args = await self._queue.get()
            try:
                await self.main.call("metrics", method, list(args))
            except ConnectionError as exc:
                log.warning("a metrics report was lost: %s", exc)
            finally:
                self._queue.task_done()

    def request_finished(self, outcome: str, ttft_s: float | None, tpot_s: float | None,
                         e2e_s: float, prompt_tokens: int, completion_tokens: int) -> None:
        self._send("request_finished", outcome, ttft_s, tpot_s, e2e_s, prompt_tokens,
                   completion_tokens)

    def request_rejected(self, code: str) -> None:
        self._send("request_rejected", code)

    def request_migrated(self) -> None:
        self._send("request_migrated")

    def first_token(self, phases: tuple[tuple[str, float], ...]) -> None:
        self._send("first_token", [list(p) for p in phases])

    def update_instances(self, statuses: list) -> None:
        pass

    async def stop(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Send what is queued (bounded by ``timeout_s``), then stop."""
        if self._task is not None:
            try:
                await asyncio.wait_for(self._queue.join(), timeout_s)
            except asyncio.TimeoutError:
                log.warning("%d metrics report(s) not sent at stop", self._queue.qsize())
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


def metrics_op(metrics: Any) -> Callable[[str, list], None]:
    """The first replica's ``"metrics"`` op: apply a forwarded report to ``metrics``."""
    allowed = {"request_finished", "request_rejected", "request_migrated", "first_token"}

    def apply(method: str, args: list) -> None:
        if method not in allowed:
            raise ValueError(f"metrics method {method!r} is not forwarded")
        getattr(metrics, method)(*args)
    return apply

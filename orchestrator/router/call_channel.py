"""Router end of one leader's call connection (``router.leader_calls: socket``;
rank/call_server.py has the wire and the leader end).

:meth:`CallChannel.call` sends one :data:`~rank.messages.LeaderRequest` on the channel's
connection and returns the leader's answer, or raises what the leader's handler raised (the
same exception a Ray call's ``RayTaskError`` carries as its cause). The connection is made on
the first call: the leader's address and token come over Ray (``open_calls``, through the
channel's handle), then one TCP connection carries every call, each waiting for the answer
with its own id. A connection that breaks fails the calls in flight on it with
:class:`CallConnectionLost` (never resent: a call may have run); the next call connects
again, through the same handle. Calls are not bounded here: the caller bounds each
(:meth:`orchestrator.router.leader.LeaderClient.call`), and a cancelled call only stops
waiting (its answer is dropped when it comes, as a Ray call's).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
from typing import Any

from rank.call_server import LEN, MAX_FRAME_BYTES, OK, frame

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 30.0  # the Ray call for the address (it may wait for a free actor thread)
CONNECT_TIMEOUT_S = 5.0  # the TCP connect


class CallConnectionLost(ConnectionError):
    """The connection to the leader broke (or closed) while the call was in flight or before
    it was sent; whether the leader ran it is unknown. The message names the instance."""


class LeaderRaised(RuntimeError):
    """The leader's handler raised an exception that could not be rebuilt here; the message is
    its first line (``Type: text``), as the Ray path reports it."""


class CallChannel:
    """One leader's calls over TCP (see the module docstring). Use on one event loop.

    Args:
        name: instance name (in errors and task names).
        handle: the leader actor handle; ``handle.open_calls.remote()`` gives
            (host, port, token) (``rank.rank.Rank.open_calls``).
    """

    def __init__(self, name: str, handle: Any) -> None:
        self.name, self.handle = name, handle
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task | None = None
        self._closed = False

    async def call(self, request: Any) -> Any:
        """``request``'s answer from the leader.

        Raises:
            CallConnectionLost: no connection could be made, or it broke before the answer.
            Exception: what the handler raised (:class:`LeaderRaised` when it did not unpickle),
                or what the Ray call for the leader's address raised (a dead actor's error).
        """
        conn = await self._connection()
        return await conn.call(request)

    async def close(self) -> None:
        """Close the connection: calls in flight fail with :class:`CallConnectionLost`, and so
        does every later call (the router is stopping, or the handle was replaced)."""
        self._closed = True
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            await asyncio.wait({self._connecting}, timeout=CONNECT_TIMEOUT_S)
        if self._conn is not None:
            await self._conn.close("the router closed it")

    async def _connection(self) -> "_Connection":
        """The live connection, made by the first call that needs one (the others wait for
        the same attempt; NOTE: shielded, so a caller that gives up does not cancel it)."""
        if self._conn is not None and self._conn.broken is None:
            return self._conn
        if self._closed:
            raise CallConnectionLost(f"{self.name}: the leader call channel is closed")
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
            self._connecting.add_done_callback(_retrieve)
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        except asyncio.CancelledError:
            if connecting.cancelled() and not asyncio.current_task().cancelling():
                # NOTE: the channel closed under a waiting call: the call fails, it is not
                # cancelled (the flow reads a failed call as the instance's failure)
                raise CallConnectionLost(f"{self.name}: the leader call channel closed "
                                         "while connecting") from None
            raise

    async def _connect(self) -> "_Connection":
        """Ask the leader for its call server over Ray, connect, say the token.

        Raises:
            CallConnectionLost: the Ray call or the connect timed out, or the connect failed.
            Exception: what the Ray call raised, unchanged (a dead actor reads as over Ray).
        """
        try:
            host, port, token = await asyncio.wait_for(_awaited(self.handle.open_calls.remote()),
                                                       OPEN_TIMEOUT_S)
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                    CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            raise CallConnectionLost(f"{self.name}: connecting to its leader's call server "
                                     f"failed: {type(exc).__name__}: {exc}") from exc
        writer.write(frame(bytes(token)))
        self._conn = _Connection(self.name, reader, writer)
        return self._conn


class _Connection:
    """One TCP connection: calls by id, one reader task resolving them."""

    def __init__(self, name: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.name, self._reader, self._writer = name, reader, writer
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self.broken: str | None = None  # why the connection ended
        self._task = asyncio.create_task(self._read_answers(), name=f"calls-{name}")

    async def call(self, request: Any) -> Any:
        if self.broken is not None:
            raise self._lost()
        call_id = next(self._ids)
        answer = self._pending[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._writer.write(frame(LEN.pack(call_id) + pickle.dumps(request)))
            await self._writer.drain()
            return await answer
        except (OSError, RuntimeError) as exc:  # RuntimeError: a closed transport
            if isinstance(exc, CallConnectionLost) or answer.done():
                raise
            self._end(f"{type(exc).__name__}: {exc}")
            raise self._lost() from exc
        finally:
            self._pending.pop(call_id, None)

    async def close(self, why: str) -> None:
        self._end(why)
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=CONNECT_TIMEOUT_S)

    def _lost(self) -> CallConnectionLost:
        return CallConnectionLost(f"{self.name}: the connection to its leader's call server "
                                  f"ended ({self.broken}); the call may or may not have run")

    def _end(self, why: str) -> None:
        """Fail every call in flight (once) and close the socket."""
        if self.broken is not None:
            return
        self.broken = why
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(self._lost())
        self._writer.close()

    async def _read_answers(self) -> None:
        try:
            while True:
                (size,) = LEN.unpack(await self._reader.readexactly(LEN.size))
                if size > MAX_FRAME_BYTES:
                    raise ValueError(f"an answer of {size} bytes")
                body = await self._reader.readexactly(size)
                (call_id,) = LEN.unpack_from(body)
                answer = self._pending.get(call_id)
                if answer is not None and not answer.done():
                    _resolve(answer, body[LEN.size], body[LEN.size + 1:])
        except asyncio.IncompleteReadError:
            self._end("closed by the leader")
        except (OSError, ValueError) as exc:
            self._end(f"{type(exc).__name__}: {exc}")
        finally:
            self._end("closed")


def _resolve(answer: asyncio.Future, status: int, payload: bytes) -> None:
    """Set ``answer`` from one answer frame's status byte and payload."""
    try:
        if status == OK:
            answer.set_result(pickle.loads(payload))
            return
        exc, line = pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - an answer that does not unpickle fails its call
        answer.set_exception(LeaderRaised(f"the answer did not unpickle: {exc}"))
        return
    answer.set_exception(exc if isinstance(exc, Exception) else LeaderRaised(line))


async def _awaited(ref: Any) -> Any:
    return await ref


def _retrieve(task: asyncio.Task) -> None:
    """Mark a connect's failure seen (its callers may all have given up)."""
    if not task.cancelled():
        task.exception()

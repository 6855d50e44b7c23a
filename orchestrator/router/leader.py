"""Router-side view of instance leaders: bounded, typed calls.

``LeaderClient`` wraps one leader handle (a Ray actor handle of a ``rank.rank.Rank``, or an
in-process fake whose methods also have ``.remote(...)`` returning an awaitable) with typed,
bounded calls: ``call`` (one :data:`~rank.messages.LeaderRequest`: a Ray actor call, or with
``router.leader_calls: socket`` a frame on the leader's call connection,
orchestrator/router/call_channel.py), ``open_events`` and ``status`` (always Ray). The
events the leaders send back are the event pump's (orchestrator/router/event_pump.py).

Fencing: an instance the health monitor declared failed (:meth:`LeaderClient.fence`) is out of
the requests' way until it is restarted (:meth:`LeaderClient.rebind`): its events are dropped
(a hung leader that wakes up must not hand a first token to a request that moved on), an attempt
that comes to depend on it fails at once (the pump), and calls that start work on it are
refused (aborts still go: they free what it holds).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from engine.error_text import first_line
from orchestrator.router.call_channel import CallChannel, LeaderRaised
from orchestrator.router.reports import InstanceReports
from orchestrator.router.event_stream import StreamAddress
from rank.messages import Abort, InstanceStatusInfo, LeaderRequest

log = logging.getLogger(__name__)


def _brief(exc: BaseException) -> str:
    """One line for a failed actor call: the worker's own error, or that the actor died."""
    from ray.exceptions import RayActorError  # ActorDiedError, ActorUnavailableError

    name = type(exc).__name__
    if isinstance(exc, LeaderRaised):  # NOTE: its text is already the worker's line
        return str(exc)
    if isinstance(exc, RayActorError):
        return (f"{name}: a rank process of this instance is gone (orch restarts the "
                "instance; `orch status` shows it)")
    cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError wraps the worker's
    if isinstance(cause, BaseException) and cause is not exc:
        return _brief(cause)
    return first_line(exc)


class LeaderError(RuntimeError):
    """A leader call failed or did not answer in time; the message names instance and method."""


async def _resolve(ref: Any) -> Any:
    return await ref


class LeaderClient:
    """Bounded async calls to one instance leader.

    Args:
        name: instance name ("decode-0").
        role: "prefill", "decode" or "colocated".
        handle: the leader actor handle.
        call_timeout_s: default bound of one call (seconds).
        calls: how :meth:`call` reaches the leader: ``"ray"`` (an actor call) or
            ``"socket"`` (its call connection, :class:`CallChannel`; ``router.leader_calls``).
    """

    def __init__(self, name: str, role: str, handle: Any, call_timeout_s: float,
                 calls: str = "ray") -> None:
        if calls not in ("ray", "socket"):
            raise ValueError(f"leader calls over {calls!r}: expected 'ray' or 'socket'")
        self.name, self.role, self.handle = name, role, handle
        self.call_timeout_s = call_timeout_s
        self._channel = CallChannel(name, handle) if calls == "socket" else None
        self._abandon: asyncio.Future[str] | None = None  # shared by the calls in flight
        self._rebound: asyncio.Future[None] | None = None  # done at the next rebind
        self.fenced: str | None = None  # why it was declared failed; None: in service
        self._closing: set[asyncio.Future] = set()  # replaced channels being closed

    def fence(self, reason: str) -> None:
        """The instance was declared failed (dead or hung, ``reason``): until :meth:`rebind`
        its events are dropped and calls that start work on it fail (module docstring)."""
        self.fenced = reason

    def abandon_calls(self, reason: str) -> None:
        """The instance is known dead or hung: every call in flight fails now with a
        LeaderError naming ``reason`` (later calls go out as usual)."""
        if self._abandon is not None and not self._abandon.done():
            self._abandon.set_result(reason)
        self._abandon = None

    def rebind(self, handle: Any) -> None:
        """Send every later call (the EventPump's polls too) to ``handle``: the instance's
        new leader after a restart (``orchestrator/deploy/recovery.py``). Calls already sent finish
        or fail on the old one (over the socket: they fail now, the old connection closed);
        the event pump follows the new leader's stream."""
        self.handle, self.fenced = handle, None
        if self._channel is not None:
            old, self._channel = self._channel, CallChannel(self.name, handle)
            self._closing.add(asyncio.ensure_future(old.close()))
            self._closing = {t for t in self._closing if not t.done()}
        if self._rebound is not None and not self._rebound.done():
            self._rebound.set_result(None)

    def rebound(self) -> asyncio.Future[None]:
        """Done at the next :meth:`rebind` (call on the router loop)."""
        if self._rebound is None or self._rebound.done():
            self._rebound = asyncio.get_running_loop().create_future()
        return self._rebound

    async def call(self, request: LeaderRequest, *, timeout_s: float | None = None) -> Any:
        """``await handle.request.remote(request)`` (or the same over the call connection)
        bounded by ``timeout_s``; errors name the request as ``decode-0.reserve`` (its type,
        lower case), with the same text over both.

        Raises:
            LeaderError: the call raised, the actor died (the call connection broke), no
                answer within the bound, the call was abandoned (:meth:`abandon_calls`), or
                the instance is fenced (:meth:`fence`) and the request is not an ``Abort``.
        """
        if self.fenced is not None and not isinstance(request, Abort):
            raise LeaderError(f"{self.name}.{type(request).__name__.lower()} refused: the "
                              f"instance was declared failed ({self.fenced}) and is not back "
                              "yet")
        channel = self._channel
        send = (lambda: self.handle.request.remote(request)) if channel is None else \
            (lambda: channel.call(request))
        return await self._bounded(type(request).__name__.lower(), send, timeout_s)

    async def close(self) -> None:
        """Close the call connection (none over Ray); later calls fail. The router's stop."""
        channels = [] if self._channel is None else [self._channel.close()]
        await asyncio.gather(*channels, *self._closing)

    async def open_events(self, subscriber: str, reports: InstanceReports | None = None
                          ) -> StreamAddress:
        """``handle.open_events.remote(subscriber)``: where this router follows the leader's
        token stream, asking for the heartbeat and status periods of ``reports`` when given.
        Raises as :meth:`call`."""
        periods = {} if reports is None else {"beat_s": reports.beat_s,
                                              "status_s": reports.status_s}
        return await self._bounded(
            "open_events", lambda: self.handle.open_events.remote(subscriber, **periods), None)

    async def status(self, *, timeout_s: float | None = None) -> InstanceStatusInfo:
        """``handle.status.remote()`` bounded by ``timeout_s``. Raises as :meth:`call`."""
        return await self._bounded("status", lambda: self.handle.status.remote(), timeout_s)

    async def _bounded(self, method: str, send: Callable[[], Any],
                       timeout_s: float | None) -> Any:
        """``await send()`` (one actor call) bounded by ``timeout_s``; ``method`` names it in
        errors."""
        bound = self.call_timeout_s if timeout_s is None else timeout_s
        if self._abandon is None:
            self._abandon = asyncio.get_running_loop().create_future()
        abandon = self._abandon
        try:
            answer = asyncio.ensure_future(_resolve(send()))
            try:
                await asyncio.wait({answer, abandon}, timeout=bound,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not answer.done():
                    answer.cancel()  # NOTE: takes effect later: done() stays False for now
            if answer.done():
                return answer.result()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # Ray wraps worker exceptions; keep the cause in the text
            raise LeaderError(f"{self.name}.{method} failed: {_brief(exc)}") from exc
        if abandon.done():
            raise LeaderError(f"{self.name}.{method} was abandoned: {abandon.result()}")
        raise LeaderError(f"{self.name}.{method} did not answer within {bound:.1f} s: the "
                          "instance may be stuck or overloaded; check its logs")


async def cancel_task(task: asyncio.Future, timeout_s: float) -> None:
    """Cancel ``task`` and wait (at most ``timeout_s``) until it ends.

    NOTE: the cancel is repeated while it runs on: in Python 3.11 ``asyncio.wait_for`` swallows
    a cancel that races its inner future's completion, and the stream loop then reads on."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    cancelled = False
    while not task.done() and loop.time() < deadline:
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=0.05)
        except asyncio.CancelledError:
            cancelled = True  # NOTE: the caller is cancelled too: end ``task`` first
    if cancelled:
        raise asyncio.CancelledError

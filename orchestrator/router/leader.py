"""Router-side view of instance leaders: bounded actor calls and the event pump.

``LeaderClient`` wraps one leader handle (a Ray actor handle of a ``rank.rank.Rank``, or an
in-process fake whose methods also have ``.remote(...)`` returning an awaitable) with typed,
bounded calls: ``call`` (one :data:`~rank.messages.LeaderRequest`: a Ray actor call, or with
``router.leader_calls: socket`` a frame on the leader's call connection,
orchestrator/router/call_channel.py), ``open_events`` and ``status`` (always Ray).
``EventPump`` runs one asyncio task per leader that follows the leader's token stream
(orchestrator/router/event_stream.py: one frame per leader step, no Ray call per step) and fans
its token events out to per-attempt :class:`Inbox`es, keeping only the events of instances the
attempt watches; each decode frame's free KV blocks go to
``on_capacity`` (the admission queue). When a leader's stream is lost, the inbox of every
attempt watching it raises :class:`InstanceFailure`, so nothing waits forever.

Fencing: an instance the health monitor declared failed (:meth:`LeaderClient.fence`) is out of
the requests' way until it is restarted (:meth:`LeaderClient.rebind`): its events are dropped
(a hung leader that wakes up must not hand a first token to a request that moved on), an attempt
that comes to depend on it fails at once, and calls that start work on it are refused (aborts
still go: they free what it holds). An event carrying
prefix-cache events (``TokenEvent.kv_events``, no request) goes to the router's
:class:`KVIndex` instead.
"""

from __future__ import annotations

import asyncio
import time
import logging
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.error_text import first_line
from orchestrator.router.call_channel import CallChannel, LeaderRaised
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.reports import InstanceReports
from orchestrator.router.request import InstanceFailure, request_failed
from orchestrator.router.event_stream import (EventFrame, EventSubscription, StreamAddress,
                                              StreamBroken)
from rank.messages import Abort, InstanceStatusInfo, LeaderRequest, TokenEvent

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


class Inbox:
    """One attempt's events from the pump, in arrival order, and the failures among them.

    :meth:`take` returns token events and raises failures: a worker's error event
    (retryable: :class:`InstanceFailure`, else INTERNAL) or an instance found failed
    (:meth:`fail`). Items of an instance the attempt stopped depending on are dropped
    (:meth:`narrow`). One consumer, on the router loop; every item names its instance.

    Args:
        request_id: the client's id, named in the errors ``take`` raises.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._items: deque[TokenEvent | InstanceFailure] = deque()
        self.first_token_at: float | None = None  # monotonic: the first token event came
        # NOTE: done while an item waits; a fresh future once every item is taken.
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def put(self, event: TokenEvent) -> None:
        if event.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self._add(event)

    def fail(self, instance: str, error: str) -> None:
        """``instance`` failed: :meth:`take` raises :class:`InstanceFailure` once the items
        before it are taken."""
        self._add(request_failed(self.request_id, instance, error, retryable=True))

    def narrow(self, instances: set[str]) -> None:
        """Drop what came from other instances (a prefill failure queued before the first
        token moved the request on to its decode only)."""
        self._items = deque(item for item in self._items if item.instance in instances)
        self._rearm()

    def take(self) -> TokenEvent | None:
        """The next token event, merged with the token events of the same instance queued
        right behind it (a router that fell behind streams fewer, larger chunks; an error
        stays for the next take); None when nothing waits.

        Raises:
            InstanceFailure: an instance failed (dead, unreachable, broken).
            RequestError: INTERNAL, the worker's error for this request.
        """
        if not self._items:
            return None
        item = self._items.popleft()
        if isinstance(item, InstanceFailure):
            self._rearm()
            raise item
        if item.finish_reason == "error":
            self._rearm()
            raise request_failed(self.request_id, item.instance, item.error or "",
                                 item.retryable)
        item = self._merge(item)
        self._rearm()
        return item

    def _merge(self, first: TokenEvent) -> TokenEvent:
        """``first`` and the queued token events behind it from its instance, up to the first
        that ends the request, as one event."""
        merged = [first]
        while (merged[-1].finish_reason is None and self._items
               and isinstance(self._items[0], TokenEvent)
               and self._items[0].instance == first.instance
               and self._items[0].finish_reason != "error"):
            merged.append(self._items.popleft())
        if len(merged) == 1:
            return first
        last = merged[-1]
        # NOTE: every per-token field is concatenated, every per-request one kept
        return replace(first, token_ids=tuple(t for e in merged for t in e.token_ids),
                       finish_reason=last.finish_reason, retryable=last.retryable,
                       logprobs=tuple(lp for e in merged for lp in e.logprobs),
                       num_cached_tokens=max(e.num_cached_tokens for e in merged))

    def _add(self, item: TokenEvent | InstanceFailure) -> None:
        self._items.append(item)
        if not self.ready.done():
            self.ready.set_result(None)

    def _rearm(self) -> None:
        if not self._items and self.ready.done():
            self.ready = asyncio.get_running_loop().create_future()


class EventPump:
    """Fans leader events out to per-attempt :class:`Inbox`es; one stream task per leader.

    Args:
        leaders: every leader that produces events.
        retry_s: pause after a lost stream before subscribing again (seconds).
        on_capacity: ``(instance, free_blocks, group_free)`` for every frame of a decode
            leader (``group_free``: :attr:`EventFrame.group_free`).
        subscriber: this router's id at the leaders (default: a fresh one).
        kv_index: where instances' prefix-cache events go (None: dropped).
        reports: where the leaders' liveness and status reports go (None: not asked for).
    """

    def __init__(self, leaders: list[LeaderClient], retry_s: float = 0.5,
                 on_capacity: Callable[[str, int, dict[str, int] | None], None] | None = None,
                 subscriber: str | None = None, kv_index: KVIndex | None = None,
                 reports: InstanceReports | None = None) -> None:
        self._leaders = leaders
        self._retry_s = retry_s
        self._on_capacity = on_capacity
        self.kv_index = kv_index
        self.reports = reports
        self.subscriber = subscriber or f"router-{uuid.uuid4().hex[:12]}"
        self._inboxes: dict[str, Inbox] = {}  # attempt id -> its inbox
        self._sources: dict[str, set[str]] = {}  # attempt id -> instances it waits on
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    def start(self) -> None:
        """Start one stream task per leader (call from the event loop)."""
        self._tasks = [asyncio.create_task(self._run(leader), name=f"events-{leader.name}")
                       for leader in self._leaders]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the stream tasks (bounded wait)."""
        self._stopping = True
        await asyncio.gather(*(cancel_task(t, timeout_s) for t in self._tasks))
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            log.warning("event stream tasks still running after stop: %s", pending)
        self._tasks = []

    def add_leader(self, leader: LeaderClient) -> None:
        """Follow ``leader``'s stream too (a new instance; call from the event loop)."""
        self._leaders.append(leader)
        if self._tasks and not self._stopping:
            self._tasks.append(asyncio.create_task(self._run(leader),
                                                   name=f"events-{leader.name}"))

    async def remove_leader(self, name: str) -> None:
        """Stop following instance ``name`` (removed; nothing watches it any more)."""
        self._leaders = [leader for leader in self._leaders if leader.name != name]
        tasks = [t for t in self._tasks if t.get_name() == f"events-{name}"]
        for task in tasks:
            self._tasks.remove(task)
        await asyncio.gather(*(cancel_task(t, self._retry_s + 5.0) for t in tasks))

    def register(self, attempt_id: str, request_id: str, instances: set[str]) -> Inbox:
        """An inbox receiving ``attempt_id``'s events from ``instances`` from now on
        (``request_id``: the client's, for its errors)."""
        inbox = self._inboxes[attempt_id] = Inbox(request_id)
        self._sources[attempt_id] = set(instances)
        return inbox

    def widen(self, attempt_id: str, instances: set[str]) -> None:
        """The attempt also depends on ``instances`` from now on: their events reach its
        inbox and their failure fails it (at once for one that is fenced)."""
        if attempt_id not in self._sources:
            return
        self._sources[attempt_id] |= set(instances)
        for leader in self._leaders:
            if leader.name in instances and leader.fenced is not None:
                self._inboxes[attempt_id].fail(leader.name, f"{leader.name} failed: "
                                                            f"{leader.fenced}")

    def watch(self, attempt_id: str, instances: set[str]) -> None:
        """The attempt now depends on exactly ``instances`` (fewer than before): only their
        events reach its inbox, only their failure fails it, what others queued is dropped."""
        if attempt_id in self._sources:
            self._sources[attempt_id] = set(instances)
            self._inboxes[attempt_id].narrow(instances)

    def fail_instance(self, instance: str, error: str) -> int:
        """Fail every attempt watching ``instance`` (its inbox raises
        :class:`InstanceFailure`); returns how many were told."""
        watching = [a for a, sources in self._sources.items() if instance in sources]
        for attempt_id in watching:
            self._inboxes[attempt_id].fail(instance, error)
        return len(watching)

    def unregister(self, attempt_id: str) -> None:
        """Stop routing events of ``attempt_id``; later events for it are dropped."""
        self._inboxes.pop(attempt_id, None)
        self._sources.pop(attempt_id, None)

    async def _run(self, leader: LeaderClient) -> None:
        """Follow ``leader``'s stream; a lost one fails its watchers, then we subscribe again
        (through ``leader.handle``: a rebind switches to the new leader at once)."""
        sub = EventSubscription(leader.name, leader.role, self.subscriber,
                                lambda subscriber: _open(leader, subscriber, self.reports),
                                keep=self._wanted)
        failing = False  # NOTE: one warning per run of failures, the rest at debug
        while not self._stopping:
            rebound = leader.rebound()
            follow = asyncio.ensure_future(self._follow(leader, sub))
            try:
                await asyncio.wait({follow, rebound}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_task(follow, timeout_s=5.0)
            if follow.cancelled():
                continue  # rebound: the new leader's stream
            try:
                follow.result()
                failing = False
            except StreamBroken as exc:
                log.log(logging.DEBUG if failing else logging.WARNING, "%s", exc)
                failing = True
                self.fail_instance(leader.name, str(exc))
                if self.reports is not None:
                    self.reports.lost(leader.name)
                await asyncio.sleep(self._retry_s)

    async def _follow(self, leader: LeaderClient, sub: EventSubscription) -> None:
        async for frame in sub.frames():
            self._dispatch(leader, frame)

    def _wanted(self, row: list) -> bool:
        """Whether an event row (rank/event_stream.py ``event_row``: [request_id, ...,
        kv_events]) is for this router: an attempt of its own, or prefix-cache events."""
        return row[0] in self._sources or row[7] is not None

    def _dispatch(self, leader: LeaderClient, frame: EventFrame) -> None:
        if self.reports is not None:
            self.reports.heard(leader.name, frame.ranks_age_s, frame.status)
        if leader.fenced is not None:  # NOTE: declared failed: nothing it says is used
            if frame.events:
                log.debug("dropped %d event(s) of fenced %s", len(frame.events), leader.name)
            return
        for event in frame.events:
            if event.kv_events is not None:
                if self.kv_index is not None:
                    self.kv_index.apply(leader.name, event.kv_events)
                continue
            # NOTE: an instance the attempt no longer watches (a failed attempt's, or
            # prefill after the first token) cannot end it with a late event.
            if leader.name not in self._sources.get(event.request_id, ()):
                log.debug("dropped event of %s from %s", event.request_id, leader.name)
                continue
            self._inboxes[event.request_id].put(event)
        if self._on_capacity is not None and leader.role == "decode":
            self._on_capacity(leader.name, frame.free_blocks, frame.group_free)


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


async def _open(leader: LeaderClient, subscriber: str,
                reports: InstanceReports | None) -> StreamAddress:
    try:
        return await leader.open_events(subscriber, reports)
    except LeaderError as exc:
        raise StreamBroken(str(exc)) from exc

"""The event pump: every leader's token events, fanned out to the attempts that wait for them.

:class:`EventPump` runs one asyncio task per leader that follows the leader's token stream
(orchestrator/router/event_stream.py: one frame per leader step, no Ray call per step) and fans
its token events out to per-attempt :class:`Inbox`es, keeping only the events of instances the
attempt watches; each decode frame's free KV blocks go to ``on_capacity`` (the admission
queue), an event carrying prefix-cache events (``TokenEvent.kv_events``, no request) to the
router's :class:`KVIndex`. When a leader's stream is lost, the inbox of every attempt watching
it raises :class:`InstanceFailure`, so nothing waits forever. A fenced leader's events
(:meth:`LeaderClient.fence`, orchestrator/router/leader.py) are dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from orchestrator.router.event_stream import (EventFrame, EventSubscription, StreamAddress,
                                              StreamBroken)
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.leader import LeaderClient, LeaderError, cancel_task
from orchestrator.router.reports import InstanceReports
from orchestrator.router.request import InstanceFailure, request_failed
from rank.messages import TokenEvent

log = logging.getLogger(__name__)


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


async def _open(leader: LeaderClient, subscriber: str,
                reports: InstanceReports | None) -> StreamAddress:
    try:
        return await leader.open_events(subscriber, reports)
    except LeaderError as exc:
        raise StreamBroken(str(exc)) from exc

"""Admission queue: requests waiting for decode KV blocks, first come first served, no polling.

A request that found every decode instance full (a retryable :class:`~rank.messages.Rejection`),
or that arrived while others wait, takes its place at the tail of one FIFO; at most
``max_pending`` wait, each until its deadline. Nothing is retried on a timer: decode leaders
report their free KV blocks with every event frame (rank/event_stream.py), and each report
(:meth:`AdmissionQueue.report`) grants waiters, from the head, an instance whose reported free
blocks cover what the decode said they need (``Rejection.blocks_needed``). The first waiter that
fits nowhere stops the walk: no later request overtakes it. A granted waiter tries that one
instance; rejected again (the report was stale, another router took the blocks) it keeps its
place and waits for the next report, which the decode sends whenever its free blocks change.
A grant that was not used (the request left: aborted, timed out) gives its blocks back to the
estimate. Liveness guard: a head that got no grant for ``HEAD_RECHECK_S`` (a report lost with a
restarting instance) tries the first instance once; the waiters behind it cost nothing.

DeepSeek-V4 decode instances admit by their KV group pools too (window, entries, state:
engine/v4/admission.py): their frames also carry each group's uncommitted blocks and their
refusals each group's need (``Rejection.group_blocks_needed``), and a grant needs both the
blocks and every group's need to fit, by the same rules. A V4 request that finishes gives its
group blocks back in the frame that reports it, which wakes the waiters as free blocks do.

Priority: a migrating request (``RequestSpec.num_resumed_tokens > 0``: its client has tokens
already, docs/scaling.md) takes its place ahead of every new arrival, behind earlier migrating
ones (FIFO among them), and tries the decode instances at once when only new arrivals wait.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from orchestrator.router.request import RequestError

HEAD_RECHECK_S = 5.0


@dataclass(eq=False)
class _Waiter:
    request_id: str
    priority: bool = False  # migrating: ahead of every new arrival
    # NOTE: its prompt is computed (eager prefill) and holds prefill blocks: ahead of the
    # migrating ones, which would hold decode blocks while they wait for prefill room
    computed: bool = False
    need: int = 1  # blocks the decode asked for (1 until one said)
    groups: dict[str, int] = field(default_factory=dict)  # V4: KV group -> blocks it commits
    charged: str | None = None  # instance whose estimate this grant took ``need`` from
    granted: asyncio.Future = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


class AdmissionQueue:
    """At most ``max_pending`` waiting requests (0 = reject at once when decode is full).

    ``order``: the decode instances a grant may name, in the policy's order (healthy ones);
    the flow sets it.
    """

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.order: Callable[[], list[str]] = lambda: []
        self._queue: deque[_Waiter] = deque()  # arrival order
        self._free: dict[str, int] = {}  # instance -> reported free blocks, less grants since
        # NOTE: V4 instance -> KV group -> reported uncommitted blocks, less grants since
        self._groups: dict[str, dict[str, int]] = {}
        self._ended: dict[str, RequestError] = {}  # request id -> why it must stop waiting
        self._placing: set[str] = set()  # requests holding a ticket (queued or not)
        self._priority: set[str] = set()  # those of them whose client has tokens already
        self._closed: RequestError | None = None

    @property
    def waiting(self) -> int:
        """Requests in the queue (granted ones trying an instance included)."""
        return len(self._queue)

    def ahead_of(self, priority: bool, computed: bool = False) -> int:
        """Waiters a request entering now would queue behind: every one for a new arrival;
        the computed and migrating ones for a migrating request (``priority``); the computed
        ones for a request whose prompt is computed already (``computed``: eager prefill).

        NOTE: computed prompts go first: a reserve-first request given decode room before
        them would hold it while it waits for the prefill blocks they hold (a deadlock until
        the deadlines, seen after a decode restart under load)."""
        level = _level(priority, computed)
        return sum(1 for w in self._queue if _level(w.priority, w.computed) <= level)

    def report(self, instance: str, free_blocks: int,
               group_free: dict[str, int] | None = None) -> None:
        """``instance`` has ``free_blocks`` free now and (DeepSeek-V4) ``group_free``
        uncommitted blocks per KV group (its event frame): grant what fits."""
        self._free[instance] = free_blocks
        if group_free is None:
            self._groups.pop(instance, None)
        else:
            self._groups[instance] = dict(group_free)
        self._grant()

    def full(self, instance: str, need: int, groups: dict[str, int] | None = None) -> None:
        """``instance`` refused ``need`` blocks (V4: and ``groups``' blocks per KV group): no
        grant of that size there until it reports again."""
        self._free[instance] = min(self._free.get(instance, need - 1), need - 1)
        if groups:
            room = self._groups.setdefault(instance, {})
            for name, n in groups.items():
                room[name] = min(room.get(name, n - 1), n - 1)

    def lost(self, instance: str) -> None:
        """A call to ``instance`` failed: no grant there until it reports again."""
        self._free[instance] = 0

    def regrant(self) -> None:
        """The instances ``order`` names changed (health): grant what fits now."""
        self._grant()

    def cancel(self, request_id: str, error: RequestError) -> bool:
        """End the wait of ``request_id`` with ``error``; False when it holds no ticket."""
        if request_id not in self._placing:
            return False
        self._ended[request_id] = error
        for waiter in self._queue:
            if waiter.request_id == request_id and not waiter.granted.done():
                waiter.granted.set_exception(error)
        return True

    def fail_waiting(self, error: RequestError) -> int:
        """End every wait now in the queue with ``error`` (later ones wait as usual): a role
        the requests need is gone for good. Returns how many were ended."""
        ended = 0
        for waiter in self._queue:
            if not waiter.granted.done():
                self._ended[waiter.request_id] = error
                waiter.granted.set_exception(error)
                ended += 1
        return ended

    def close(self, error: RequestError) -> None:
        """End every wait, now and later, with ``error`` (router shutting down), but those
        of priority tickets: their clients have tokens (a migration, a late reservation),
        so they go on waiting for room within their deadline and the router's drain limit."""
        self._closed = error
        for waiter in self._queue:
            if not waiter.granted.done() and not waiter.priority:
                waiter.granted.set_exception(error)

    def check(self, request_id: str) -> None:
        """Raise the error that ended this request's wait, if any."""
        closed = None if request_id in self._priority else self._closed
        error = closed or self._ended.get(request_id)
        if error is not None:
            raise error

    @asynccontextmanager
    async def ticket(self, request_id: str, priority: bool = False, computed: bool = False
                     ) -> AsyncIterator["Ticket"]:
        """A ticket for one request's reservation attempts (``priority``: its client has
        tokens, a migration or a late reservation; ``computed``: its prompt is computed on a
        prefill already; see :meth:`ahead_of` for the order); leaves the queue on exit."""
        ticket = Ticket(self, request_id, priority, computed)
        self._placing.add(request_id)
        if priority:
            self._priority.add(request_id)
        try:
            yield ticket
        finally:
            self._placing.discard(request_id)
            self._priority.discard(request_id)
            self._ended.pop(request_id, None)
            if ticket.waiter is not None:
                self._leave(ticket.waiter, ticket.reserved)

    def _leave(self, waiter: _Waiter, reserved: bool) -> None:
        self._queue.remove(waiter)
        waiter.granted.cancel()  # NOTE: marks it; nobody awaits it any more
        if waiter.charged in self._free and not reserved:
            self._charge(waiter.charged, waiter, -1)  # an unused grant
        self._grant()

    def _fits(self, instance: str, waiter: _Waiter) -> bool:
        """The estimate of ``instance`` covers ``waiter``'s blocks and, where the instance
        reports KV groups, each of its group needs (an instance or group not reported yet
        counts as room)."""
        room = self._groups.get(instance, {})
        return self._free.get(instance, waiter.need) >= waiter.need and \
            all(room.get(name, n) >= n for name, n in waiter.groups.items())

    def _charge(self, instance: str, waiter: _Waiter, sign: int) -> None:
        """Take (``sign`` 1) or give back (-1) ``waiter``'s need from ``instance``'s estimate."""
        self._free[instance] -= sign * waiter.need
        room = self._groups.get(instance)
        for name, n in waiter.groups.items() if room is not None else ():
            if name in room:
                room[name] -= sign * n

    def _grant(self) -> None:
        """From the head: each idle waiter gets the first instance its need fits (by the
        reports); stop at the first that fits nowhere."""
        order = None
        for waiter in self._queue:
            if waiter.granted.done():  # trying an instance, or ended
                continue
            order = self.order() if order is None else order
            name = next((n for n in order if self._fits(n, waiter)), None)
            if name is None:
                return
            waiter.charged = name if name in self._free else None
            if waiter.charged:
                self._charge(name, waiter, 1)
            waiter.granted.set_result(name)

    def _enter(self, request_id: str, reason: str, priority: bool = False,
               computed: bool = False) -> _Waiter:
        if len(self._queue) >= self.max_pending:
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"request {request_id}: every decode instance is full ({reason}) and the "
                f"admission queue is full ({len(self._queue)} waiting, router.max_pending="
                f"{self.max_pending}): retry later, or raise router.max_pending / "
                "decode.num_kv_blocks / decode.dp")
        waiter = _Waiter(request_id, priority, computed=computed)
        # NOTE: the queue stays ordered by level, FIFO within one
        self._queue.insert(self.ahead_of(priority, computed), waiter)
        return waiter


class Ticket:
    """One request's place in the admission queue (taken on its first wait)."""

    def __init__(self, queue: AdmissionQueue, request_id: str, priority: bool = False,
                 computed: bool = False) -> None:
        self._queue, self.request_id, self.priority = queue, request_id, priority
        self.computed = computed
        self.waiter: _Waiter | None = None
        self.reserved = False  # set by the caller once a reservation used the grant

    async def wait(self, deadline: float, reason: str, need: int | None = None,
                   groups: dict[str, int] | None = None) -> str:
        """Wait for a decode instance that reported room for ``need`` blocks (None: what the
        last rejection said, else 1) and, DeepSeek-V4, ``groups``' blocks per KV group
        (``Rejection.group_blocks_needed``; None: what the last rejection said), at most until
        ``deadline`` (time.monotonic()); the first call takes the place at the tail (a
        migrating request's: behind the migrating ones), later ones keep it. Returns the
        instance.

        Raises:
            RequestError: RESOURCE_EXHAUSTED when the queue is full or the deadline passed;
                the cancel/close error when the wait was ended.
        """
        queue = self._queue
        queue.check(self.request_id)
        if self.waiter is None:
            self.waiter = queue._enter(self.request_id, reason, self.priority, self.computed)
        elif self.waiter.granted.done():
            self.waiter.granted = asyncio.get_running_loop().create_future()
            self.waiter.charged = None  # NOTE: refused or failed: the estimate says so now
        if need is not None:
            self.waiter.need = max(1, need)
        if groups is not None:
            self.waiter.groups = dict(groups)
        queue._grant()
        while True:
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                return await asyncio.wait_for(asyncio.shield(self.waiter.granted),
                                              min(left, HEAD_RECHECK_S))
            except asyncio.TimeoutError:
                queue.check(self.request_id)
                if left > HEAD_RECHECK_S:
                    self._recheck()
                    continue
                raise RequestError(
                    "RESOURCE_EXHAUSTED",
                    f"request {self.request_id} waited router.request_timeout_s for decode KV "
                    f"blocks ({reason}): retry later, or raise decode.num_kv_blocks / decode.dp"
                    " / router.request_timeout_s") from None

    def _recheck(self) -> None:
        """The liveness guard (module docstring): the head tries the first instance."""
        queue, waiter = self._queue, self.waiter
        order = queue.order()
        if queue._queue and queue._queue[0] is waiter and order and not waiter.granted.done():
            waiter.granted.set_result(order[0])


def _level(priority: bool, computed: bool) -> int:
    """A waiter's place in the queue's order: 0 computed prompts, 1 migrating, 2 new."""
    return 0 if computed else 1 if priority else 2

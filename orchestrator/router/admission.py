"""Bounded admission queue: requests waiting for a decode instance to have KV blocks.

A request whose reservation was rejected as retryable (decode full for now) takes a ticket and
waits; at most ``max_pending`` requests wait at once, each at most until its deadline. Waiters
wake when any request ends (:meth:`AdmissionQueue.notify`) or every ``retry_s`` seconds (blocks
may free without the router seeing it), then try to reserve again.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

from orchestrator.router.request import RequestError


class AdmissionQueue:
    """At most ``max_pending`` waiting requests (0 = reject at once when decode is full);
    ``retry_s``: longest sleep between two reservation attempts, seconds."""

    def __init__(self, max_pending: int, retry_s: float = 0.2) -> None:
        self.max_pending, self.retry_s = max_pending, retry_s
        self.waiting = 0
        self._changed = asyncio.Event()
        self._placing: set[str] = set()  # requests holding a ticket (queued or not)
        self._ended: dict[str, RequestError] = {}  # request id -> why it must stop waiting
        self._closed: RequestError | None = None

    def cancel(self, request_id: str, error: RequestError) -> bool:
        """End the wait of ``request_id`` with ``error``; False when it holds no ticket."""
        if request_id not in self._placing:
            return False
        self._ended[request_id] = error
        self.notify()
        return True

    def close(self, error: RequestError) -> None:
        """End every wait, now and later, with ``error`` (router shutting down)."""
        self._closed = error
        self.notify()

    def check(self, request_id: str) -> None:
        """Raise the error that ended this request's wait, if any."""
        error = self._closed or self._ended.get(request_id)
        if error is not None:
            raise error

    def notify(self) -> None:
        """Capacity may have freed: wake every waiter to retry."""
        self._changed.set()
        self._changed = asyncio.Event()

    @asynccontextmanager
    async def ticket(self, request_id: str) -> AsyncIterator["Ticket"]:
        """A ticket for one request's reservation attempts; leaves the queue on exit."""
        ticket = Ticket(self, request_id)
        self._placing.add(request_id)
        try:
            yield ticket
        finally:
            self._placing.discard(request_id)
            self._ended.pop(request_id, None)
            if ticket.queued:
                self.waiting -= 1

    def _enter(self, request_id: str, reason: str) -> None:
        if self.waiting >= self.max_pending:
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"request {request_id}: every decode instance is full ({reason}) and the "
                f"admission queue is full ({self.waiting} waiting, router.max_pending="
                f"{self.max_pending}): retry later, or raise router.max_pending / "
                "decode.num_kv_blocks / decode.dp")
        self.waiting += 1


class Ticket:
    """One request's place in the admission queue (taken on its first wait)."""

    def __init__(self, queue: AdmissionQueue, request_id: str) -> None:
        self._queue, self.request_id = queue, request_id
        self.queued = False

    async def wait(self, deadline: float, reason: str) -> None:
        """Wait until capacity may have freed, at most until ``deadline`` (time.monotonic()).

        Raises:
            RequestError: RESOURCE_EXHAUSTED when the queue is full or the deadline passed;
                the cancel/close error when the wait was ended.
        """
        self._queue.check(self.request_id)
        if not self.queued:
            self._queue._enter(self.request_id, reason)
            self.queued = True
        left = deadline - time.monotonic()
        if left <= 0:
            raise RequestError(
                "RESOURCE_EXHAUSTED",
                f"request {self.request_id} waited router.request_timeout_s for decode KV "
                f"blocks ({reason}): retry later, or raise decode.num_kv_blocks / decode.dp / "
                "router.request_timeout_s")
        changed = self._queue._changed
        try:
            await asyncio.wait_for(changed.wait(), min(left, self._queue.retry_s))
        except asyncio.TimeoutError:
            pass
        self._queue.check(self.request_id)

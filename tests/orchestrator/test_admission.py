"""Admission queue: notify, cancel and close wake waiters at once, not at the next poll.

Every queue here polls every ``POLL_S`` seconds; a waiter that is not woken would sleep that
long, so each test bounds the wake-up far below it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.router.admission import AdmissionQueue
from orchestrator.router.request import RequestError

POLL_S = 30.0  # AdmissionQueue.retry_s: the fallback poll interval
PROMPT_S = 2.0  # "promptly": well under POLL_S, generous for a loaded machine


async def _wait_once(queue: AdmissionQueue, request_id: str) -> float:
    """Take a ticket and wait once; seconds from the start of the wait to its end."""
    async with queue.ticket(request_id) as ticket:
        start = time.monotonic()
        await ticket.wait(time.monotonic() + 2 * POLL_S, "decode full")
        return time.monotonic() - start


async def _until_waiting(queue: AdmissionQueue, n: int) -> None:
    while queue.waiting < n:
        await asyncio.sleep(0.01)


def test_notify_wakes_every_waiter_promptly():
    async def go():
        queue = AdmissionQueue(max_pending=3, retry_s=POLL_S)
        waits = [asyncio.create_task(_wait_once(queue, f"r{i}")) for i in range(3)]
        await asyncio.wait_for(_until_waiting(queue, 3), PROMPT_S)
        await asyncio.sleep(0.05)  # every waiter is inside its wait, not before it
        queue.notify()
        return await asyncio.wait_for(asyncio.gather(*waits), PROMPT_S)

    waited = asyncio.run(go())
    assert all(w < PROMPT_S for w in waited), waited


def test_notify_before_a_wait_does_not_wake_it():
    """A notify only wakes the waits already waiting (the next wait is for the next change)."""
    async def go():
        queue = AdmissionQueue(max_pending=1, retry_s=0.3)
        queue.notify()
        return await _wait_once(queue, "r")

    assert asyncio.run(go()) >= 0.25


def test_cancel_ends_only_that_wait_promptly_with_its_error():
    async def go():
        queue = AdmissionQueue(max_pending=2, retry_s=POLL_S)
        cancelled = asyncio.create_task(_wait_once(queue, "gone"))
        other = asyncio.create_task(_wait_once(queue, "stays"))
        await asyncio.wait_for(_until_waiting(queue, 2), PROMPT_S)
        await asyncio.sleep(0.05)
        assert queue.cancel("gone", RequestError("CANCELLED", "aborted by the client"))
        assert not queue.cancel("unknown", RequestError("CANCELLED", "x"))
        with pytest.raises(RequestError, match="aborted by the client"):
            await asyncio.wait_for(cancelled, PROMPT_S)
        waited = await asyncio.wait_for(other, PROMPT_S)  # the notify woke it to retry
        return waited, queue.waiting

    waited, waiting = asyncio.run(go())
    assert waited < PROMPT_S and waiting == 0


def test_close_ends_every_wait_promptly_and_every_later_one():
    async def go():
        queue = AdmissionQueue(max_pending=2, retry_s=POLL_S)
        waits = [asyncio.create_task(_wait_once(queue, f"r{i}")) for i in range(2)]
        await asyncio.wait_for(_until_waiting(queue, 2), PROMPT_S)
        await asyncio.sleep(0.05)
        queue.close(RequestError("UNAVAILABLE", "router stopping"))
        done = await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), PROMPT_S)
        with pytest.raises(RequestError, match="router stopping"):
            await _wait_once(queue, "late")
        return done, queue.waiting

    done, waiting = asyncio.run(go())
    assert [(e.code, e.message) for e in done] == [("UNAVAILABLE", "router stopping")] * 2
    assert waiting == 0

"""Admission queue: FIFO grants on decode capacity reports (free blocks), no polling; migrating
requests ahead of new arrivals; cancel and close end waits at once. The queue alone, on one
event loop (DeepSeek-V4's KV groups: test_admission_v4.py; through the router:
test_admission_router.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from orchestrator.router import admission
from orchestrator.router.admission import AdmissionQueue
from orchestrator.router.request import RequestError

PROMPT_S = 2.0  # "promptly", generous for a loaded machine
FAR = 60.0  # a deadline no test reaches


def _queue(max_pending: int = 8) -> AdmissionQueue:
    queue = AdmissionQueue(max_pending)
    queue.order = lambda: ["decode-0", "decode-1"]
    for name in queue.order():  # NOTE: full; an instance that never reported counts as room
        queue.report(name, 0)
    return queue


async def _take(queue: AdmissionQueue, request_id: str, need: int, granted: list,
                hold: asyncio.Event | None = None, priority: bool = False,
                computed: bool = False) -> None:
    """Wait for a grant, record (request id, instance), keep the place until ``hold``
    (``priority``: a migrating request; ``computed``: its prompt is computed, eager)."""
    async with queue.ticket(request_id, priority, computed) as ticket:
        granted.append((request_id, await ticket.wait(time.monotonic() + FAR, "full", need)))
        if hold is not None:
            await hold.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _arrive_then_grant(arrivals, ahead_args, first_room: int):
    """Requests of 2 blocks arrive one by one (``arrivals``: (id, priority, computed)); then
    decode-0 reports ``first_room`` free blocks and decode-1 4. Returns (``ahead_of(*args)``
    for each of ``ahead_args`` before any grant, the grants after decode-0's report, all
    grants in order)."""
    queue, granted, done = _queue(), [], asyncio.Event()
    tasks = []
    for rid, priority, computed in arrivals:
        tasks.append(asyncio.create_task(
            _take(queue, rid, 2, granted, done, priority, computed)))
        await _settle()  # arrival order as listed
    ahead = tuple(queue.ahead_of(*args) for args in ahead_args)
    queue.report("decode-0", first_room)
    await _settle()
    first = list(granted)
    queue.report("decode-1", 4)
    await _settle()
    done.set()
    await asyncio.gather(*tasks)
    return ahead, first, granted


def test_a_migrating_request_goes_ahead_of_new_arrivals_behind_earlier_migrating_ones():
    ahead, first, granted = asyncio.run(_arrive_then_grant(
        (("new-a", False, False), ("new-b", False, False), ("moved-1", True, False),
         ("moved-2", True, False)), ((True,), (False,)), first_room=5))
    assert ahead == (2, 4)
    assert first == [("moved-1", "decode-0"), ("moved-2", "decode-0")]
    assert [rid for rid, _ in granted] == ["moved-1", "moved-2", "new-a", "new-b"]


def test_computed_prompts_go_ahead_of_migrating_requests_and_new_arrivals():
    """An eager prompt already computed (holding prefill blocks) waits ahead of a migrating
    request, which would hold decode blocks while it waits for prefill room: decode room goes
    to the computed ones first, in their arrival order (a late reservation: both flags)."""
    ahead, first, granted = asyncio.run(_arrive_then_grant(
        (("new-a", False, False), ("moved-1", True, False), ("eager-1", False, True),
         ("late-1", True, True)), ((False, True), (True,), (False,)), first_room=4))
    assert ahead == (2, 3, 4)
    assert first == [("eager-1", "decode-0"), ("late-1", "decode-0")]
    assert [rid for rid, _ in granted] == ["eager-1", "late-1", "moved-1", "new-a"]


def test_grants_follow_arrival_order_and_nobody_passes_a_head_that_does_not_fit():
    async def go():
        queue, granted, done = _queue(), [], asyncio.Event()
        tasks = []
        for rid, need in (("a", 4), ("b", 1), ("c", 2)):
            tasks.append(asyncio.create_task(_take(queue, rid, need, granted, done)))
            await _settle()  # arrival order a, b, c
        queue.report("decode-0", 3)  # b would fit, but a waits ahead of it
        await _settle()
        before = list(granted)
        queue.report("decode-0", 5)  # a (4) fits, then b (1); c (2) does not
        await _settle()
        middle = list(granted)
        queue.report("decode-1", 2)  # c fits on the other instance
        await _settle()
        done.set()
        await asyncio.gather(*tasks)
        return before, middle, granted, queue.waiting

    before, middle, granted, waiting = asyncio.run(go())
    assert before == []
    assert middle == [("a", "decode-0"), ("b", "decode-0")]
    assert granted == middle + [("c", "decode-1")]
    assert waiting == 0


def test_a_refused_grant_keeps_its_place_until_the_next_report():
    """The granted request found the blocks taken (stale report): it stays at the head, the
    instance is not granted again before it reports, and the next report serves it first."""
    async def go():
        queue, order = _queue(), []

        async def first():
            async with queue.ticket("a") as ticket:
                name = await ticket.wait(time.monotonic() + FAR, "full", 2)
                queue.full(name, 2)  # the reserve was refused
                order.append(("a", await ticket.wait(time.monotonic() + FAR, "full", 2)))

        a = asyncio.create_task(first())
        await _settle()
        b = asyncio.create_task(_take(queue, "b", 2, order))
        await _settle()
        queue.report("decode-0", 2)  # a is granted and refused
        await _settle()
        stale = list(order)
        queue.report("decode-0", 4)  # a first, then b
        await asyncio.gather(a, b)
        return stale, order

    stale, order = asyncio.run(go())
    assert stale == []
    assert order == [("a", "decode-0"), ("b", "decode-0")]


def test_without_a_report_a_wait_ends_at_its_deadline():
    async def go():
        queue = _queue()
        async with queue.ticket("r") as ticket:
            start = time.monotonic()
            with pytest.raises(RequestError) as err:
                await ticket.wait(start + 0.3, "decode-0 is full", 1)
            return time.monotonic() - start, err.value

    waited, err = asyncio.run(go())
    assert 0.25 <= waited < PROMPT_S
    assert err.code == "RESOURCE_EXHAUSTED" and "decode-0 is full" in err.message


def test_cancel_ends_only_that_wait_promptly_and_the_next_in_line_moves_up():
    async def go():
        queue, granted = _queue(), []
        gone = asyncio.create_task(_take(queue, "gone", 4, granted))
        await _settle()
        stays = asyncio.create_task(_take(queue, "stays", 1, granted))
        await _settle()
        queue.report("decode-0", 1)  # gone (4) blocks stays (1)
        await _settle()
        assert granted == []
        assert queue.cancel("gone", RequestError("CANCELLED", "aborted by the client"))
        assert not queue.cancel("unknown", RequestError("CANCELLED", "x"))
        with pytest.raises(RequestError, match="aborted by the client"):
            await asyncio.wait_for(gone, PROMPT_S)
        await asyncio.wait_for(stays, PROMPT_S)  # its turn came with the cancel
        return granted, queue.waiting

    granted, waiting = asyncio.run(go())
    assert granted == [("stays", "decode-0")] and waiting == 0


def test_close_ends_every_wait_promptly_and_every_later_one():
    async def go():
        queue = _queue()
        waits = [asyncio.create_task(_take(queue, f"r{i}", 1, [])) for i in range(2)]
        await _settle()
        queue.close(RequestError("UNAVAILABLE", "router stopping"))
        done = await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), PROMPT_S)
        with pytest.raises(RequestError, match="router stopping"):
            await _take(queue, "late", 1, [])
        return done, queue.waiting

    done, waiting = asyncio.run(go())
    assert [(e.code, e.message) for e in done] == [("UNAVAILABLE", "router stopping")] * 2
    assert waiting == 0


def test_the_queue_is_bounded_by_max_pending():
    async def go():
        queue = _queue(max_pending=1)
        first = asyncio.create_task(_take(queue, "a", 1, []))
        await _settle()
        with pytest.raises(RequestError) as err:
            await _take(queue, "b", 1, [])
        first.cancel()
        return err.value

    err = asyncio.run(go())
    assert err.code == "RESOURCE_EXHAUSTED" and "router.max_pending=1" in err.message


def test_a_report_from_an_instance_not_yet_healthy_is_granted_once_it_is():
    """A restarted decode reports its room before the health monitor calls it healthy: the
    grant waits for the health change (Flow.health_changed -> regrant), not a later report."""
    async def go():
        queue, granted = _queue(), []
        healthy = ["decode-1"]
        queue.order = lambda: list(healthy)
        wait = asyncio.create_task(_take(queue, "r", 2, granted))
        await _settle()
        queue.report("decode-0", 8)  # not healthy yet
        await _settle()
        before = list(granted)
        healthy.append("decode-0")
        queue.regrant()
        await asyncio.wait_for(wait, PROMPT_S)
        return before, granted

    before, granted = asyncio.run(go())
    assert before == [] and granted == [("r", "decode-0")]


def test_a_grant_the_request_did_not_use_gives_its_blocks_back():
    async def go():
        queue, granted = _queue(), []

        async def leaves():  # granted, then aborted before it reserved
            async with queue.ticket("gone") as ticket:
                await ticket.wait(time.monotonic() + FAR, "full", 3)

        gone = asyncio.create_task(leaves())
        await _settle()
        stays = asyncio.create_task(_take(queue, "stays", 3, granted))
        await _settle()
        queue.report("decode-0", 3)  # room for one: "gone" is granted it
        await gone
        await asyncio.wait_for(stays, PROMPT_S)  # no new report: the unused grant came back
        return granted

    assert asyncio.run(go()) == [("stays", "decode-0")]


def test_a_head_that_hears_no_report_tries_once_and_those_behind_it_do_not(monkeypatch):
    monkeypatch.setattr(admission, "HEAD_RECHECK_S", 0.2)

    async def go():
        queue, granted, hold = _queue(), [], asyncio.Event()
        head = asyncio.create_task(_take(queue, "head", 1, granted, hold))
        await _settle()
        behind = asyncio.create_task(_take(queue, "behind", 1, granted))
        await asyncio.sleep(0.6)  # the head is granted and still trying
        first = list(granted)
        behind.cancel()
        hold.set()
        await head
        return first

    assert asyncio.run(go()) == [("head", "decode-0")]

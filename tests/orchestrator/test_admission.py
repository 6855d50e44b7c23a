"""Admission queue: FIFO grants on decode capacity reports (free blocks and, DeepSeek-V4, each KV
group's uncommitted blocks), no polling; cancel and close end waits at once. The end-to-end
tests run it through a real grpc.aio server over fake leaders."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from orchestrator.api.client import OrchClient
from orchestrator.router import admission
from orchestrator.router.admission import AdmissionQueue
from orchestrator.router.request import RequestError
from tests.orchestrator.fakes import V4_NEED, expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_router import _wait_for

PROMPT_S = 2.0  # "promptly", generous for a loaded machine
FAR = 60.0  # a deadline no test reaches


def _queue(max_pending: int = 8) -> AdmissionQueue:
    queue = AdmissionQueue(max_pending)
    queue.order = lambda: ["decode-0", "decode-1"]
    for name in queue.order():  # NOTE: full; an instance that never reported counts as room
        queue.report(name, 0)
    return queue


async def _take(queue: AdmissionQueue, request_id: str, need: int, granted: list,
                hold: asyncio.Event | None = None, priority: bool = False) -> None:
    """Wait for a grant, record (request id, instance), keep the place until ``hold``
    (``priority``: a migrating request)."""
    async with queue.ticket(request_id, priority) as ticket:
        granted.append((request_id, await ticket.wait(time.monotonic() + FAR, "full", need)))
        if hold is not None:
            await hold.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_migrating_request_goes_ahead_of_new_arrivals_behind_earlier_migrating_ones():
    async def go():
        queue, granted, done = _queue(), [], asyncio.Event()
        tasks = []
        for rid, priority in (("new-a", False), ("new-b", False), ("moved-1", True),
                              ("moved-2", True)):
            tasks.append(asyncio.create_task(_take(queue, rid, 2, granted, done, priority)))
            await _settle()  # arrival order as listed
        ahead = (queue.ahead_of(True), queue.ahead_of(False))
        queue.report("decode-0", 5)  # room for two requests of 2 blocks
        await _settle()
        first = list(granted)
        queue.report("decode-1", 4)
        await _settle()
        done.set()
        await asyncio.gather(*tasks)
        return ahead, first, granted
    ahead, first, granted = asyncio.run(go())
    assert ahead == (2, 4)
    assert first == [("moved-1", "decode-0"), ("moved-2", "decode-0")]
    assert [rid for rid, _ in granted] == ["moved-1", "moved-2", "new-a", "new-b"]


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


def test_waiting_requests_are_admitted_in_arrival_order_when_blocks_free():
    """End to end over fake leaders (decode: one request at a time): requests that arrive
    while decode is full get their first tokens in arrival order, and waiting costs no
    calls: one reserve per request, plus one refused for the first that found it full."""
    h = Harness(decode_capacity=1, max_pending=8, request_timeout_s=20.0)
    try:
        decode = h.fakes["decode-0"]
        entered, release = h.call_in_loop(lambda: decode.hold("admit"))
        results: dict[str, list] = {}
        firsts: list[str] = []
        lock = threading.Lock()

        def run(rid: str) -> None:
            with OrchClient(h.address) as client:
                chunks = []
                for chunk in client.generate(token_ids=[3, 4, 5], request_id=rid,
                                             max_tokens=4):
                    if not chunks:
                        with lock:
                            firsts.append(rid)
                    chunks.append(chunk)
                results[rid] = chunks

        threads = [threading.Thread(target=run, args=("r0",), daemon=True)]
        threads[0].start()
        h.run(entered.wait())  # r0 holds the only slot
        for i in range(1, 5):
            threads.append(threading.Thread(target=run, args=(f"r{i}",), daemon=True))
            threads[-1].start()
            deadline = time.monotonic() + 5
            while h.call_in_loop(lambda: h.router.flow.admission.waiting) < i:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        time.sleep(0.3)  # a polling queue would retry now
        reserves_while_waiting = [c for c in decode.calls if c[0] == "reserve"]
        h.call_in_loop(release.set)
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        h.close()
    order = [f"r{i}" for i in range(5)]
    assert firsts == order
    for rid in order:
        assert [t for c in results[rid] for t in c.token_ids] == expected_tokens((3, 4, 5), 4)
    assert [c[1] for c in reserves_while_waiting] == ["r0@1", "r1@2"]
    reserved = [c[1] for c in decode.calls if c[0] == "reserve"]
    assert reserved == ["r0@1", "r1@2", "r1@2", "r2@3", "r3@4", "r4@5"]


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


def test_a_migrating_stream_gets_the_freed_decode_before_a_new_arrival():
    """decode-0 holds stream m, decode-1 is full and new request n waits for blocks; decode-0
    fails: m (1 token streamed) queues ahead of n, so when decode-1 reports room m is admitted
    there first and both complete."""
    h = Harness(decode_dp=2, request_timeout_s=30.0, max_pending=8)
    try:
        d0, d1 = h.fakes["decode-0"], h.fakes["decode-1"]
        h.call_in_loop(lambda: setattr(d1, "capacity", 0))
        entered, release = h.call_in_loop(lambda: d0.hold("admit"))
        queue = h.router.flow.admission
        outputs: dict[str, list[int]] = {}

        def run(rid: str) -> None:
            with OrchClient(h.address) as client:
                outputs[rid] = [t for c in client.generate(token_ids=[3, 4, 5], request_id=rid,
                                                           max_tokens=4) for t in c.token_ids]
        streams = [threading.Thread(target=run, args=("m",), daemon=True)]
        streams[0].start()
        h.run(entered.wait())  # m streamed its first token and sits on decode-0
        h.call_in_loop(lambda: setattr(d0, "capacity", 1))  # decode-0 full too
        streams.append(threading.Thread(target=run, args=("n",), daemon=True))
        streams[1].start()
        assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 1)
        h.set_healthy(lambda name: name != "decode-0")
        h.call_in_loop(lambda: h.router.instance_failed("decode-0", "process gone"))
        assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 2)
        order = h.call_in_loop(lambda: [w.request_id for w in queue._queue])
        h.call_in_loop(lambda: setattr(d1, "capacity", 1))
        h.call_in_loop(lambda: d1.stream.flush(d1.free_blocks()))  # decode-1 reports room
        for t in streams:
            t.join(20)
        h.call_in_loop(release.set)
    finally:
        h.close()
    assert order[0].startswith("m") and order[1].startswith("n"), order
    assert [c[1] for c in d1.calls if c[0] == "admit"][0].startswith("m")
    assert outputs == {rid: expected_tokens((3, 4, 5), 4) for rid in ("m", "n")}


def test_a_v4_waiter_waits_for_its_kv_groups_and_wakes_when_a_report_frees_them():
    """Free blocks alone do not grant a DeepSeek-V4 waiter: each KV group must have its need
    uncommitted; a report that frees a group (the same free blocks) grants at once, and a
    grant charges every group, so the waiter behind waits for the next report."""
    need = {"window": 2, "entries/csa": 3}

    async def go():
        queue, granted = _queue(), []

        async def take(rid: str) -> None:
            async with queue.ticket(rid) as ticket:
                granted.append((rid, await ticket.wait(time.monotonic() + FAR, "full", 1,
                                                       need)))
                ticket.reserved = True  # NOTE: the grant was used: its blocks stay charged
        a = asyncio.create_task(take("a"))
        await _settle()
        b = asyncio.create_task(take("b"))
        await _settle()
        queue.report("decode-0", 8, {"window": 4, "entries/csa": 2})  # entries short
        await _settle()
        short = list(granted)
        queue.report("decode-0", 8, {"window": 4, "entries/csa": 3})  # a request ended
        await asyncio.wait_for(a, PROMPT_S)
        await _settle()
        one = list(granted)
        queue.full("decode-0", 1, need)  # b is not granted before the next report either
        queue.report("decode-0", 8, {"window": 4, "entries/csa": 6})
        await asyncio.wait_for(b, PROMPT_S)
        return short, one, granted

    short, one, granted = asyncio.run(go())
    assert short == [] and one == [("a", "decode-0")]
    assert granted == [("a", "decode-0"), ("b", "decode-0")]


def test_a_refused_v4_waiter_gets_no_grant_before_the_groups_change():
    """A V4 refusal lowers the instance's group estimate below the need: nothing is granted
    there until the instance reports again (the report resets the estimate)."""
    need = {"window": 2}

    async def go():
        queue, granted = _queue(), []
        queue.report("decode-0", 8, {"window": 4})
        queue.full("decode-0", 1, need)  # a stale report: the decode refused
        wait = asyncio.create_task(_take_groups(queue, "r", need, granted))
        await _settle()
        before = list(granted)
        queue.report("decode-0", 8, {"window": 2})
        await asyncio.wait_for(wait, PROMPT_S)
        return before, granted

    before, granted = asyncio.run(go())
    assert before == [] and granted == [("r", "decode-0")]


async def _take_groups(queue: AdmissionQueue, request_id: str, groups: dict[str, int],
                       granted: list) -> None:
    async with queue.ticket(request_id) as ticket:
        granted.append((request_id, await ticket.wait(time.monotonic() + FAR, "full", 1,
                                                      groups)))


def test_a_v4_waiter_is_admitted_promptly_when_a_finished_request_frees_its_groups():
    """End to end over fake leaders: a DeepSeek-V4 decode whose KV groups hold one request
    (free blocks for eight). r1 waits while r0 runs; r0's last frames report free blocks but
    its group blocks go back only later, in a frame of their own: r1 is not granted on the
    free blocks (no refused reserve while the groups are short), and the groups' frame admits
    it at once, with HEAD_RECHECK_S at its 5 s."""
    pools = {name: n + 1 for name, n in V4_NEED.items()}  # room for one request
    h = Harness(max_pending=8, request_timeout_s=20.0, decode_groups=pools)
    try:
        decode = h.fakes["decode-0"]
        entered, release = h.call_in_loop(lambda: decode.hold("admit"))
        _, release_groups = h.call_in_loop(lambda: decode.hold("release_groups"))
        firsts: dict[str, float] = {}
        outputs: dict[str, list[int]] = {}

        def run(rid: str) -> None:
            with OrchClient(h.address) as client:
                tokens = []
                for chunk in client.generate(token_ids=[3, 4, 5], request_id=rid,
                                             max_tokens=4):
                    firsts.setdefault(rid, time.monotonic())
                    tokens += chunk.token_ids
                outputs[rid] = tokens
        threads = [threading.Thread(target=run, args=(rid,), daemon=True)
                   for rid in ("r0", "r1")]
        threads[0].start()
        h.run(entered.wait())  # r0 holds the groups
        threads[1].start()
        assert _wait_for(lambda: h.call_in_loop(lambda: h.router.flow.admission.waiting) == 1)
        h.call_in_loop(release.set)
        threads[0].join(10)
        time.sleep(0.3)  # r0's frames (free blocks) reached the router
        waiting = [c[1] for c in decode.calls if c[0] == "reserve"]
        released_at = time.monotonic()
        h.call_in_loop(release_groups.set)
        threads[1].join(10)
        assert not any(t.is_alive() for t in threads)
        groups, committed = h.call_in_loop(lambda: (decode.group_free(), set(decode.committed)))
    finally:
        h.close()
    assert admission.HEAD_RECHECK_S == 5.0
    assert waiting == ["r0@1", "r1@2"]
    assert firsts["r1"] - released_at < PROMPT_S
    assert [c[1] for c in decode.calls if c[0] == "reserve"] == ["r0@1", "r1@2", "r1@2"]
    assert outputs == {rid: expected_tokens((3, 4, 5), 4) for rid in ("r0", "r1")}
    assert groups == pools and committed == set()  # every group block given back once


def test_a_granted_waiter_whose_decode_call_fails_waits_for_the_next_report():
    """A waiter granted an instance whose reserve call then fails keeps its place and is
    admitted on the next report (it used to fail: the failure's message was taken for the
    blocks it needs)."""
    h = Harness(decode_capacity=1, max_pending=8, request_timeout_s=20.0)
    try:
        decode = h.fakes["decode-0"]
        queue = h.router.flow.admission
        entered, release = h.call_in_loop(lambda: decode.hold("admit"))
        outputs: dict[str, list[int]] = {}

        def run(rid: str) -> None:
            with OrchClient(h.address) as client:
                outputs[rid] = [t for c in client.generate(token_ids=[3, 4, 5], request_id=rid,
                                                           max_tokens=4) for t in c.token_ids]
        threads = [threading.Thread(target=run, args=(rid,), daemon=True)
                   for rid in ("r0", "r1")]
        threads[0].start()
        h.run(entered.wait())
        threads[1].start()
        assert _wait_for(lambda: h.call_in_loop(lambda: queue.waiting) == 1)

        def room(capacity: int) -> None:
            decode.capacity = capacity
            decode.flush()
        h.call_in_loop(lambda: decode.errors.__setitem__("reserve", "reserve broke"))
        h.call_in_loop(lambda: room(3))  # 2 free (1 last reported): granted; the call fails

        def reserves() -> int:
            return sum(c[0] == "reserve" for c in decode.calls)
        # NOTE: well inside HEAD_RECHECK_S: the reports, not the liveness guard, grant
        assert _wait_for(lambda: reserves() == 3, PROMPT_S)
        h.call_in_loop(lambda: decode.errors.pop("reserve"))
        h.call_in_loop(lambda: room(4))
        assert _wait_for(lambda: reserves() == 4, PROMPT_S)
        h.call_in_loop(release.set)
        for t in threads:
            t.join(10)
            assert not t.is_alive()
    finally:
        h.close()
    assert outputs == {rid: expected_tokens((3, 4, 5), 4) for rid in ("r0", "r1")}

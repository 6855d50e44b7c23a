"""Admission of DeepSeek-V4 requests: a waiter is granted only when each KV group has its need
uncommitted (free blocks alone do not do), a refusal holds until the groups change, and end
to end a finished request's group blocks admit the next waiter at once."""

from __future__ import annotations

import asyncio
import threading
import time

from orchestrator.api.client import OrchClient
from orchestrator.router import admission
from orchestrator.router.admission import AdmissionQueue
from tests.orchestrator.fakes import V4_NEED, expected_tokens
from tests.orchestrator.harness import Harness
from tests.orchestrator.test_admission import FAR, PROMPT_S, _queue, _settle
from tests.orchestrator.test_router import _wait_for


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

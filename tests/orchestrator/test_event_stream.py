"""The token path (rank/event_stream.py -> orchestrator/router/event_stream.py) over real
loopback sockets: frames in order and each token once across reconnects, a router that does not
read never blocks the leader (frames coalesce, no token lost), lost frames and a gone leader
are reported, not skipped."""

from __future__ import annotations

import asyncio
import threading
import time

import msgpack
import pytest

from orchestrator.router.event_stream import EventSubscription, StreamBroken
from rank import event_stream
from rank.event_stream import EventStream
from rank.messages import TokenEvent
from tests.orchestrator.descriptors import connect_during_shortage
from tests.orchestrator.drip import seconds_until_closed


def _subscription(stream: EventStream, subscriber: str = "router-a") -> EventSubscription:
    async def open_events(sub: str):
        return stream.open(sub)
    return EventSubscription("decode-0", "decode", subscriber, open_events)


def _publish(stream: EventStream, first: int, n: int, free: int = 7) -> None:
    """Frames with tokens first..first+n-1, one per frame, for request "r"."""
    for i in range(first, first + n):
        stream.add(TokenEvent("r", (i,), None, source="decode", instance="decode-0"))
        stream.flush(free)


async def _collect(sub: EventSubscription, tokens: int, timeout_s: float = 10.0):
    """(seqs, tokens) of frames until ``tokens`` tokens came."""
    seqs, got = [], []

    async def run():
        async for frame in sub.frames():
            seqs.append(frame.seq)
            got.extend(t for e in frame.events for t in e.token_ids)
            if len(got) >= tokens:
                return
    await asyncio.wait_for(run(), timeout_s)
    return seqs, got


def test_tokens_arrive_in_order_and_once_across_reconnects():
    stream = EventStream("decode-0", "127.0.0.1")
    total = 3000

    def leader(stop: threading.Event):
        _publish(stream, 0, 10)
        for start in range(10, total, 290):
            time.sleep(0.01)
            stream.break_connections()  # the router's connection drops mid-stream
            _publish(stream, start, min(290, total - start))

    async def go():
        sub = _subscription(stream)
        stop = threading.Event()
        collect = asyncio.create_task(_collect(sub, total))
        await asyncio.sleep(0.05)
        thread = threading.Thread(target=leader, args=(stop,), daemon=True)
        thread.start()
        seqs, got = await collect
        thread.join(5)
        return seqs, got

    try:
        seqs, got = asyncio.run(go())
    finally:
        stream.close()
    assert got == list(range(total))  # in order, none twice, none lost
    assert seqs == list(range(len(seqs)))


def test_every_router_replica_gets_every_event_in_order_across_reconnects():
    """router.replicas: each replica subscribes under its own id and receives every frame
    (it keeps its own requests' events), in order and once, while connections break."""
    stream = EventStream("decode-0", "127.0.0.1")
    total = 1200

    def leader():
        _publish(stream, 0, 10)
        for start in range(10, total, 199):
            time.sleep(0.01)
            stream.break_connections()
            _publish(stream, start, min(199, total - start))

    async def go():
        subs = [_subscription(stream, name) for name in ("router-a", "router-b")]
        for name in ("router-a", "router-b"):
            stream.open(name)  # NOTE: both outboxes exist before the first frame
        collects = [asyncio.create_task(_collect(sub, total)) for sub in subs]
        await asyncio.sleep(0.05)
        thread = threading.Thread(target=leader, daemon=True)
        thread.start()
        results = await asyncio.gather(*collects)
        thread.join(5)
        return results

    try:
        results = asyncio.run(go())
    finally:
        stream.close()
    for seqs, got in results:
        assert got == list(range(total))
        assert seqs == list(range(len(seqs)))


def test_a_router_that_does_not_read_never_blocks_the_leader_and_loses_no_token():
    stream = EventStream("decode-0", "127.0.0.1")
    try:
        stream.open("router-a")  # subscribed, not connected: every frame waits
        start = time.perf_counter()
        _publish(stream, 0, 20_000)
        publish_s = time.perf_counter() - start
        frames = len(stream._outboxes["router-a"].frames)
        seqs, got = asyncio.run(_collect(_subscription(stream), 20_000))
    finally:
        stream.close()
    assert publish_s < 5.0
    assert frames == event_stream.MAX_UNSENT  # the rest coalesced into the newest frame
    assert got == list(range(20_000))
    assert seqs == list(range(event_stream.MAX_UNSENT))


def test_a_resume_from_frames_no_longer_kept_is_reported(monkeypatch):
    monkeypatch.setattr(event_stream, "RETAIN", 4)
    stream = EventStream("decode-0", "127.0.0.1")

    async def go():
        first = _subscription(stream)
        await _collect(first, 20)
        _publish(stream, 20, 10)  # the first 20 frames are past RETAIN now
        late = _subscription(stream)  # same subscriber, resuming at seq 0 of this leader
        late._epoch = stream.epoch
        with pytest.raises(StreamBroken, match="lost frames"):
            await _collect(late, 1)

    try:
        _publish(stream, 0, 0)
        stream.open("router-a")
        _publish(stream, 0, 20)
        asyncio.run(go())
    finally:
        stream.close()


def test_a_gone_leader_breaks_the_stream_after_a_few_resumes():
    stream = EventStream("decode-0", "127.0.0.1")

    async def go():
        sub = _subscription(stream)
        collect = asyncio.create_task(_collect(sub, 100))
        await asyncio.sleep(0.05)
        _publish(stream, 0, 3)
        await asyncio.sleep(0.05)
        stream.close()  # the process is gone: no listener any more
        with pytest.raises(StreamBroken, match="could not be resumed"):
            await collect

    asyncio.run(go())


def test_free_blocks_alone_make_a_frame_once_per_change():
    stream = EventStream("decode-0", "127.0.0.1")
    try:
        stream.open("router-a")
        made = [stream.flush(5), stream.flush(5), stream.flush(4)]
        frames = [list(f) for f in stream._outboxes["router-a"].frames]
    finally:
        stream.close()
    assert made == [True, False, True]
    assert frames == [[0, 5, [], None, None, None], [1, 4, [], None, None, None]]  # no report


def test_v4_group_blocks_alone_make_a_frame_once_per_change():
    """A DeepSeek-V4 decode's uncommitted group blocks ride every frame; a change of them
    alone (a finished request's commitment back, its free blocks already reported) makes a
    frame, as free blocks do."""
    stream = EventStream("decode-0", "127.0.0.1")
    try:
        stream.open("router-a")
        made = [stream.flush(5, None, {"window": 2}), stream.flush(5, None, {"window": 2}),
                stream.flush(5, None, {"window": 4})]
        frames = [list(f) for f in stream._outboxes["router-a"].frames]
    finally:
        stream.close()
    assert made == [True, False, True]
    assert [f[5] for f in frames] == [{"window": 2}, {"window": 4}]


def test_events_emitted_around_a_subscription_keep_their_order():
    """A leader's emit racing the first router's subscription (the first request of a fresh
    deployment): what went to the poll queue before is not overtaken by what came after."""
    import queue
    import types

    from rank.leader import Leader

    leader = object.__new__(Leader)  # NOTE: only the event path's state
    leader.stream = EventStream("decode-0", "127.0.0.1")
    leader._events = queue.Queue()
    leader.wake = threading.Event()
    leader.pool = types.SimpleNamespace(num_free_blocks=3, take_events=lambda: None)
    leader.scheduler = types.SimpleNamespace(admission_free=lambda: None)  # NOTE: MLA
    leader.ranks = types.SimpleNamespace(followers=[])  # NOTE: no followers: ranks_age_s 0
    try:
        leader.emit(TokenEvent("r", (1,), instance="decode-0"))  # before the subscription
        sub = _subscription(leader.stream)
        sub._open_events = _opener(leader)
        leader.open_events("router-a")
        leader.emit(TokenEvent("r", (2,), instance="decode-0"))
        leader.flush_events()
        leader.emit(TokenEvent("r", (3,), "length", instance="decode-0"))
        leader.flush_events()
        _, got = asyncio.run(_collect(sub, 3))
    finally:
        leader.stream.close()
    assert got == [1, 2, 3]


def _opener(leader):
    async def open_events(sub: str):
        return leader.open_events(sub)
    return open_events


def test_every_event_field_the_router_reads_survives_the_wire():
    """Logprobs, the prefix-cache count and KV events travel in the frame rows, msgpack and
    back (a field left out of the row would reach the router as its default)."""
    import msgpack

    from engine.kv_events import KVCacheEvents
    from engine.sampling_params import TokenLogprobs
    from rank.event_stream import event_from_row, event_row

    kv = KVCacheEvents(16, 2**62 + 5, stored=(1, 2), removed=(3,), reset=True, hits_tokens=32,
                       queried_tokens=48)
    events = [TokenEvent("r@1", (7, 8), None, None, "decode", "decode-0", num_cached_tokens=16,
                         logprobs=(TokenLogprobs(7, -0.25, ((7, -0.25), (9, -1.5))),
                                   TokenLogprobs(8, -2.0, ()))),
              TokenEvent("", source="decode", instance="decode-0", kv_events=kv),
              TokenEvent("r@2", (), "error", "boom", "decode", "decode-0", retryable=True)]
    for event in events:
        row = msgpack.unpackb(msgpack.packb(event_row(event), use_bin_type=True), raw=False)
        assert event_from_row(row, "decode", "decode-0") == event


def test_a_task_that_swallows_a_cancel_is_cancelled_again():
    """The pump's stop cancels until the stream task ends (Python 3.11's wait_for can swallow
    a cancel that races its inner future; the stream loop would read on)."""
    from orchestrator.router.leader import cancel_task

    async def go():
        swallowed = []

        async def stubborn():
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed.append(1)  # the first cancel is lost, as in the race

        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        await cancel_task(task, timeout_s=2.0)
        assert task.cancelled() and swallowed == [1]
    asyncio.run(go())


def test_the_accept_loop_outlives_a_descriptor_shortage():
    """accept() failing (EMFILE: the leader process out of descriptors for a moment) must not
    end the stream's listener: a router that subscribes afterwards gets its events."""
    stream = EventStream("decode-0", "127.0.0.1")
    host, port, _, _ = stream.open("router-a")
    connect_during_shortage(host, port).close()

    async def go():
        collect = asyncio.create_task(_collect(_subscription(stream), 3))
        await asyncio.sleep(0.05)
        _publish(stream, 0, 3)
        return await collect

    try:
        _, got = asyncio.run(go())
    finally:
        stream.close()
    assert got == [0, 1, 2]


def test_a_hello_sent_a_byte_at_a_time_is_bounded_as_a_whole(monkeypatch):
    """An unauthenticated peer that drips its hello cannot hold a leader thread past
    HELLO_TIMEOUT_S (a bound per recv would let a 4096-byte hello take 4096 times it)."""
    monkeypatch.setattr(event_stream, "HELLO_TIMEOUT_S", 0.5)
    stream = EventStream("decode-0", "127.0.0.1")
    try:
        host, port, _, _ = stream.open("router-a")
        hello = msgpack.packb([bytes(16), "router-a", 0], use_bin_type=True)
        closed = seconds_until_closed(host, port, event_stream._LEN.pack(len(hello)) + hello,
                                      every_s=0.15)
    finally:
        stream.close()
    assert closed is not None and closed < 1.5, closed

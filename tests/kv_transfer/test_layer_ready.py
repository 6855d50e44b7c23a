"""The device path of layer-by-layer sends (issue 27) on CPU, with a fake device module: the
forward's hook records an event on the compute stream right after a layer's write, and a
sender thread runs that layer's copies on its own stream, which waits for the event first;
the compute stream never waits. Then the connector's per-layer records, end to end in one
process: every record's copies run after its event, and the bytes equal the source; and the
rule by which a backlog of layers leaves as one record."""

from __future__ import annotations

import contextlib
import threading
from collections import deque

import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVChunk, KVLayout, KVPeer, KVPoll,
                         PrefillKVConnector, TransferConfig, wire)
from kv_transfer import layer_ready, sender
from kv_transfer.layer_ready import CopyStream, mark_written

from .cluster import wait_settled


class FakeDevice:
    """torch.cuda's Event / Stream / stream() as far as layer_ready uses them; logs calls."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.compute = self.Stream(self, "compute")
        self.local = threading.local()

    def current(self):
        return getattr(self.local, "stream", self.compute)

    class Stream:
        def __init__(self, dev, name="copy", device=None):
            self.dev, self.name = dev, name

        def wait_event(self, event):
            self.dev.log.append(("wait", self.name, event.on))

    def stream(self, s):
        @contextlib.contextmanager
        def ctx():
            old = self.current()
            self.local.stream = s
            try:
                yield
            finally:
                self.local.stream = old
        return ctx()


def fake_module(monkeypatch) -> FakeDevice:
    dev = FakeDevice()

    class Event:
        def record(self):
            self.on = dev.current().name
            dev.log.append(("record", self.on))

    dev.Event = Event
    dev.Stream = lambda device=None: FakeDevice.Stream(dev, "copy", device)
    monkeypatch.setattr(layer_ready.torch, "get_device_module", lambda kind: dev)
    return dev


def test_copies_wait_for_the_layers_event_on_their_own_stream(monkeypatch):
    dev = fake_module(monkeypatch)
    assert mark_written(torch.device("cpu")) is None  # CPU: the write is done already
    event = mark_written(torch.device("cuda", 0))
    assert dev.log == [("record", "compute")]  # on the forward's stream, after the write
    copies = CopyStream(torch.device("cuda", 0))
    with copies.after(event):
        assert dev.current().name == "copy"  # the body's copies and sends go here
        dev.log.append(("copy", dev.current().name))
    assert dev.current().name == "compute"
    assert dev.log == [("record", "compute"), ("wait", "copy", "compute"), ("copy", "copy")]
    assert not any(e[0] == "wait" and e[1] == "compute" for e in dev.log)  # compute never waits
    with copies.after(None):  # nothing to order: the body runs where it would
        assert dev.current().name == "compute"


def test_per_layer_records_run_after_their_event_and_land_whole(monkeypatch):
    seen: list[tuple[object, str]] = []

    class RecordingCopies(CopyStream):
        @contextlib.contextmanager
        def after(self, written):
            seen.append((written, threading.current_thread().name))
            yield

    monkeypatch.setattr(sender, "CopyStream", RecordingCopies)
    spec_p = KVCacheSpec(num_layers=3, num_blocks=16, block_size=4, kv_lora_rank=8,
                         qk_rope_head_dim=4)
    spec_d = KVCacheSpec(num_layers=3, num_blocks=8, block_size=8, kv_lora_rank=8,
                         qk_rope_head_dim=4)
    cfg = TransferConfig(connect_timeout_s=30, payload_timeout_s=30, completion_timeout_s=60,
                         same_node="off")
    p_cache, d_cache = KVCache(spec_p), KVCache(spec_d)
    for t in p_cache.k_caches + p_cache.v_caches:
        t.copy_(torch.randn(t.shape))
    dec = DecodeKVConnector(d_cache, KVLayout.from_spec(spec_d, "m", 1), "d0", 0, cfg)
    pre = PrefillKVConnector(p_cache, KVLayout.from_spec(spec_p, "m", 1), "p0", 0, 1, cfg)
    peers = [KVPeer("d0", 0, *dec.address)]
    src, dst = slot_mapping((3, 9, 1), 0, 12, 4), slot_mapping((2, 6), 0, 12, 8)
    try:
        dec.expect("r", 12, prefill_tp=1)
        events = [object() for _ in range(3)]
        for layer, event in enumerate(events):  # what the forward's hook does per layer
            pre.send_chunk("r", peers, 0, 12, src, dst, layers=(layer,), written=event)
        pre.finish("r", peers, 12, forward_end=1.0)
        assert pre.wait("r", 20).state is KVPoll.SUCCESS
        assert wait_settled(dec, "r").state is KVPoll.SUCCESS
        # NOTE: layers queued while the wire is busy (here: the pair's connect) go as one
        # record, after the newest of their events
        order = [events.index(w) for w, _ in seen]
        assert order == sorted(set(order)) and order[-1] == 2, order
        assert all(name.startswith("kv-send-") for _, name in seen)  # on the sender thread
        for layer in range(3):
            assert torch.equal(d_cache.flat_k(layer)[dst], p_cache.flat_k(layer)[src])
            assert torch.equal(d_cache.flat_v(layer)[dst], p_cache.flat_v(layer)[src])
        assert dec.stats.snapshot()["transfers"] == len(seen)
    finally:
        pre.close()
        dec.close()


def _task(rid: str, layers: tuple[int, ...], start: int = 0, written=None, kind=wire.DATA):
    peer = KVPeer("d0", 0, "127.0.0.1", 1)
    if kind != wire.DATA:
        return sender.SendTask(wire.Header(kind=kind, request_id=rid, prefill_rank=0,
                                           fingerprint="f", num_tokens=8), peer)
    chunk = KVChunk(rid, layers, start, start + 4, torch.arange(4), None, torch.arange(4))
    return sender.SendTask(wire.data_header(chunk, 0, "f"), peer, written)


def test_a_backlog_of_layers_goes_as_one_record_and_keeps_each_requests_order():
    """What a sender thread takes when layers queued faster than the wire moved them: the
    following layers of the same chunk join the record (waiting for the newest event);
    another request's records, another token range and anything after a done stay queued."""
    channel = sender.SenderChannel.__new__(sender.SenderChannel)  # NOTE: no thread: the rule
    queued = [_task("a", (1,), written="e1"), _task("b", (0,)), _task("a", (0,), start=4),
              _task("a", (2,), written="e2"), _task("a", (0,), kind=wire.DONE),
              _task("a", (3,), written="e3")]
    channel._queue = deque(queued)
    task, absorbed = channel._extend(_task("a", (0,), written="e0"))
    assert task.header.chunk.layers == (0, 1, 2) and task.written == "e2"
    assert absorbed == [queued[0], queued[3]]
    assert list(channel._queue) == [queued[1], queued[2], queued[4], queued[5]]
    channel._queue = deque([_task("a", (2,))])
    alone = _task("a", (0,))
    assert channel._extend(alone) == (alone, [])  # not the next layer: nothing joins

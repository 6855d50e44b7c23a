"""Prefill side of a dead or hung decode rank (issue 9, fault 5): records to it fail their
requests at once (no connect per record, backoff), an abort never waits for a connect, and a
restarted rank at a new address is paired again; no thread is left behind."""

import gc
import socket
import time

import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVLayout, KVPeer, KVPoll, KVStatus,
                         PrefillKVConnector, TransferConfig)
from tests.leaks import assert_no_kv_threads, kv_threads

# NOTE: connect_timeout_s is what a connect per record would cost; every wait below is shorter.
CFG = TransferConfig(connect_timeout_s=6, header_timeout_s=10, payload_timeout_s=10,
                     completion_timeout_s=30, retry_backoff_s=60)
SPEC = KVCacheSpec(num_layers=2, num_blocks=8, block_size=4, kv_lora_rank=8,
                   qk_rope_head_dim=4)
SRC = slot_mapping((3, 1), 0, 8, 4)
DST = slot_mapping((5, 2), 0, 8, 4)


def _prefill() -> tuple[KVCache, PrefillKVConnector]:
    cache = KVCache(SPEC)
    for t in cache.k_caches + cache.v_caches:
        t.copy_(torch.randn(t.shape))
    return cache, PrefillKVConnector(cache, KVLayout.from_spec(SPEC, "m", 1), "p0", 0, 1, CFG)


def _send(conn: PrefillKVConnector, rid: str, peers: list[KVPeer]) -> None:
    conn.send_chunk(rid, peers, 0, 8, SRC, DST)
    conn.finish(rid, peers, 8)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_decode_fails_its_requests_at_once_then_a_restarted_one_is_paired():
    before = kv_threads()
    cache, pre = _prefill()
    dead = [KVPeer("d0", 0, "127.0.0.1", _closed_port())]
    dec = None
    try:
        t0 = time.monotonic()
        for rid in ("A", "B", "C"):
            _send(pre, rid, dead)
        # NOTE: a connect per record would keep them TRANSFERRING past the wait
        status = {rid: pre.wait(rid, 3.0) for rid in ("A", "B", "C")}
        assert time.monotonic() - t0 < 3.0
        assert {s.state for s in status.values()} == {KVPoll.FAILED}, status
        assert "cannot connect" in status["A"].error and "d0/0" in status["A"].error
        assert "next try in" in status["B"].error  # backoff: no second connect
        # the decode rank restarted: same instance/rank, new address -> tried at once
        d_cache = KVCache(SPEC)
        dec = DecodeKVConnector(d_cache, KVLayout.from_spec(SPEC, "m", 1), "d0", 0, CFG)
        dec.expect("D", 8, prefill_tp=1)
        _send(pre, "D", [KVPeer("d0", 0, *dec.address)])
        assert (status := pre.wait("D", 10.0)) == KVStatus(KVPoll.SUCCESS), status
        deadline = time.monotonic() + 10
        while (status := dec.poll("D")).state is not KVPoll.SUCCESS:
            assert status.state is not KVPoll.FAILED and time.monotonic() < deadline, status
            time.sleep(0.01)
        for layer in range(SPEC.num_layers):
            assert torch.equal(d_cache.flat_k(layer)[DST], cache.flat_k(layer)[SRC])
            assert torch.equal(d_cache.flat_v(layer)[DST], cache.flat_v(layer)[SRC])
        dec.release("D")
    finally:
        pre.close()
        if dec is not None:
            dec.close()
    assert_no_kv_threads(before)


def test_abort_does_not_wait_for_a_connect_to_a_hung_decode():
    """A decode rank that accepts TCP but never answers (SIGSTOP) holds a connect for
    connect_timeout_s: the request under connect is aborted at once; the one queued behind
    it fails when that connect gives up (bounded), without a connect of its own."""
    before = kv_threads()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    hung = [KVPeer("d0", 0, "127.0.0.1", listener.getsockname()[1])]
    _, pre = _prefill()
    conns = []
    try:
        _send(pre, "A", hung)
        _send(pre, "B", hung)
        conns = [listener.accept()[0] for _ in range(2)]  # the probe, then the store client
        t0 = time.monotonic()
        pre.abort("A", hung, reason="client cancelled")
        status = pre.wait("A", 1.0)
        assert time.monotonic() - t0 < 1.0
        assert status == KVStatus(KVPoll.ABORTED, "client cancelled"), status
        status = pre.wait("B", CFG.connect_timeout_s + 3)
        assert status.state is KVPoll.FAILED and "could not connect" in status.error, status
    finally:
        pre.close()
        for c in conns:
            c.close()
        listener.close()
    # NOTE: the abandoned store constructor ends once its socket is closed (the rank is gone)
    deadline = time.monotonic() + 10
    while kv_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_no_kv_threads(before)


def test_idle_pair_to_a_dead_decode_is_torn_down_by_its_heartbeat():
    """No record is pending, so only the heartbeat can notice: the request that had records
    on the pair fails on the prefill side within a few heartbeats, not at its next record."""
    cfg = TransferConfig(connect_timeout_s=6, header_timeout_s=10, payload_timeout_s=10,
                         completion_timeout_s=30, heartbeat_s=0.2, peer_timeout_s=2.0)
    before = kv_threads()
    cache = KVCache(SPEC)
    pre = PrefillKVConnector(cache, KVLayout.from_spec(SPEC, "m", 1), "p0", 0, 1, cfg)
    dec = DecodeKVConnector(KVCache(SPEC), KVLayout.from_spec(SPEC, "m", 1), "d0", 0, cfg)
    peers = [KVPeer("d0", 0, *dec.address)]
    try:
        dec.expect("A", 8, prefill_tp=1)
        pre.send_chunk("A", peers, 0, 4, SRC[:4], DST[:4])
        assert pre.wait("A", 10.0) == KVStatus(KVPoll.WAITING)  # sent; more chunks to come
        dec.close()
        del dec
        gc.collect()  # NOTE: the decode rank's store server goes with its last reference
        deadline = time.monotonic() + 5 * cfg.heartbeat_s + 2.0
        while (status := pre.poll("A")).state is not KVPoll.FAILED:
            assert time.monotonic() < deadline, "the dead pair was not noticed"
            time.sleep(0.02)
        assert "heartbeat" in status.error, status
    finally:
        pre.close()
    assert_no_kv_threads(before)

"""Rank processes for failure tests: layout mismatch, killed prefill, killed decode."""

from __future__ import annotations

import dataclasses
import time

from engine.kv_cache import KVCache
from kv_transfer import (DecodeKVConnector, KVLayout, KVPoll, KVStatus, PrefillKVConnector,
                         TransferConfig)

from .cluster import (RID, Scenario, check_received, decode_spec, prefill_spec,
                      receive_peers, reference_prefill_cache, slots, wait_for, wait_settled)
from tests.leaks import assert_no_kv_threads, kv_threads

RID2 = "req-2"


def _decode(s: Scenario, rank: int = 0) -> tuple[KVCache, DecodeKVConnector]:
    spec = decode_spec(s)
    cache = KVCache(spec)
    layout = KVLayout.from_spec(spec, "tiny-mla", s.decode_tp)
    return cache, DecodeKVConnector(cache, layout, "d0", rank, TransferConfig(**s.timeouts))


def _prefill(s: Scenario, rank: int = 0) -> PrefillKVConnector:
    layout = KVLayout.from_spec(prefill_spec(s), "tiny-mla", s.prefill_tp)
    return PrefillKVConnector(reference_prefill_cache(s), layout, "p0", rank, s.prefill_tp,
                              TransferConfig(**s.timeouts))


def _send_all(conn: PrefillKVConnector, s: Scenario, rid: str, peers: list,
              chunks=None) -> None:
    for a, b in chunks or s.chunks:
        conn.send_chunk(rid, peers, a, b, slots(s, "prefill", a, b), slots(s, "decode", a, b))


def decode_mismatch(role, rank, s: Scenario, addr_qs) -> str:
    cache, conn = _decode(s)
    conn.expect(RID, s.num_tokens, s.prefill_tp)
    for q in addr_qs:
        q.put((rank, conn.address))
    status = wait_settled(conn, RID, 20)
    assert status.state is KVPoll.FAILED, status
    error = status.error
    assert all(not t.any() for t in cache.k_caches + cache.v_caches), "mismatched bytes written"
    conn.release(RID)
    conn.close()
    assert_no_kv_threads()
    return error


def prefill_mismatch(role, rank, s: Scenario, addr_qs) -> str:
    conn = _prefill(s, rank)
    peers = receive_peers(addr_qs[rank], s.decode_tp)
    _send_all(conn, s, RID, peers)
    conn.finish(RID, peers, s.num_tokens)
    status = conn.wait(RID, 20)
    assert status.state is KVPoll.FAILED, status
    error = status.error
    conn.close()
    assert_no_kv_threads()
    return error


def decode_survives_prefill_kill(role, rank, s: Scenario, addr_qs, chunk0, killed,
                                 restarted, expected) -> dict:
    """Prefill is killed (or stopped) after chunk 0, while idle: RID fails once its
    heartbeats stop (peer_timeout_s); a restarted prefill (new pair generation) then
    delivers RID2 completely."""
    cache, conn = _decode(s)
    conn.expect(RID, s.num_tokens, s.prefill_tp)
    for q in addr_qs:
        q.put((rank, conn.address))
    wait_for(lambda: conn.stats.snapshot()["transfers"] >= 1, 30, "chunk 0")
    t0 = time.monotonic()
    chunk0.set()
    status = wait_settled(conn, RID, 30)
    failed_after = time.monotonic() - t0
    assert status.state is KVPoll.FAILED, status
    error = status.error
    conn.release(RID)
    killed.set()  # parent starts the restarted prefill now
    assert restarted.wait(60), "restarted prefill never came up"
    conn.expect(RID2, s.num_tokens, s.prefill_tp)  # NOTE: its deadline starts now
    expected.set()
    status = wait_settled(conn, RID2, 30)
    assert status == KVStatus(KVPoll.SUCCESS), status
    check_received(s, cache)
    # the replaced generation's receiver is woken by its stop doorbell and ends (bounded wait)
    wait_for(lambda: not [n for n in kv_threads() if "-g1->" in n], 5, "old receiver gone")
    threads = kv_threads()
    conn.release(RID2)
    conn.close()
    assert_no_kv_threads()
    return {"error": error, "failed_after": failed_after, "threads_before_close": threads}


def prefill_then_hang(role, rank, s: Scenario, addr_q) -> None:
    conn = _prefill(s, rank)
    peers = receive_peers(addr_q, s.decode_tp)
    _send_all(conn, s, RID, peers, chunks=s.chunks[:1])
    assert not conn.wait(RID, 20).busy
    time.sleep(120)  # killed by the parent


def prefill_restarted(role, rank, s: Scenario, peers, restarted, expected) -> None:
    conn = _prefill(s, rank)
    restarted.set()
    assert expected.wait(30)
    _send_all(conn, s, RID2, peers)
    conn.finish(RID2, peers, s.num_tokens)
    status = conn.wait(RID2, 20)
    assert status == KVStatus(KVPoll.SUCCESS), status
    conn.close()
    assert_no_kv_threads()


def decode_then_hang(role, rank, s: Scenario, addr_q, chunk0) -> None:
    cache, conn = _decode(s)
    conn.expect(RID, s.num_tokens, s.prefill_tp)
    addr_q.put((rank, conn.address))
    wait_for(lambda: conn.stats.snapshot()["transfers"] >= 1, 30, "chunk 0")
    chunk0.set()
    time.sleep(120)  # killed by the parent


def decode_restarted(role, rank, s: Scenario, addr_q) -> None:
    # NOTE: the deadline starts before the prefill rank has read our address; be generous.
    s = dataclasses.replace(s, timeouts={**s.timeouts, "completion_timeout_s": 30.0})
    cache, conn = _decode(s)
    conn.expect(RID2, s.num_tokens, s.prefill_tp)
    addr_q.put((rank, conn.address))
    status = wait_settled(conn, RID2, 30)
    assert status == KVStatus(KVPoll.SUCCESS), status
    check_received(s, cache)
    conn.release(RID2)
    conn.close()
    assert_no_kv_threads()


def prefill_survives_decode_kill(role, rank, s: Scenario, addr_q, chunk0, killed) -> dict:
    """Decode is killed after chunk 0: RID fails on the prefill side within the timeouts;
    RID2 to a restarted decode rank (new address) goes through on a remade pair."""
    conn = _prefill(s, rank)
    peers = receive_peers(addr_q, s.decode_tp)
    _send_all(conn, s, RID, peers, chunks=s.chunks[:1])
    assert chunk0.wait(30)
    assert killed.wait(30)
    t0 = time.monotonic()
    _send_all(conn, s, RID, peers, chunks=s.chunks[1:])
    conn.finish(RID, peers, s.num_tokens)
    status = conn.wait(RID, 30)
    failed_after = time.monotonic() - t0
    assert status.state is KVPoll.FAILED, status
    error = status.error
    new_peers = receive_peers(addr_q, s.decode_tp)
    _send_all(conn, s, RID2, new_peers)
    conn.finish(RID2, new_peers, s.num_tokens)
    status = conn.wait(RID2, 30)
    assert status == KVStatus(KVPoll.SUCCESS), status
    threads = kv_threads()
    conn.close()
    assert_no_kv_threads()
    return {"error": error, "failed_after": failed_after, "threads_before_close": threads}

"""Multi-process harness for KV transfer tests: prefill and decode rank processes.

Every process rebuilds the same reference data from a seed (prefill cache contents and both
block tables), so a decode rank can check, slot by slot, that what arrived equals what the
prefill cache held. Each process reports ``(role, rank, error_or_None, info)`` on a queue.
"""

from __future__ import annotations

import queue
import time
import traceback
from dataclasses import dataclass, field

import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVLayout, KVPeer, KVPoll, KVStatus,
                         PrefillKVConnector, TransferConfig, build_transfer_plan)
from tests.leaks import assert_no_kv_threads
from tests.rank_processes import CTX

RID = "req-1"


@dataclass(frozen=True)
class Scenario:
    """One transfer: shapes, tps, chunking, what each side does."""

    prefill_tp: int
    decode_tp: int
    num_layers: int = 3
    num_tokens: int = 37
    chunks: tuple[tuple[int, int], ...] = ((0, 16), (16, 32), (32, 37))
    prefill_block: int = 4
    decode_block: int = 8
    prefill_blocks: int = 24
    decode_blocks: int = 12
    kv_lora_rank: int = 16
    rope_dim: int = 8
    prefill_dtype: str = "float32"
    decode_dtype: str = "float32"
    timeouts: dict = field(default_factory=dict)


def prefill_spec(s: Scenario) -> KVCacheSpec:
    return KVCacheSpec(s.num_layers, s.prefill_blocks, s.prefill_block, s.kv_lora_rank,
                       s.rope_dim, getattr(torch, s.prefill_dtype))


def decode_spec(s: Scenario) -> KVCacheSpec:
    return KVCacheSpec(s.num_layers, s.decode_blocks, s.decode_block, s.kv_lora_rank,
                       s.rope_dim, getattr(torch, s.decode_dtype))


def block_table(num_blocks: int, needed: int, seed: int) -> tuple[int, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(num_blocks, generator=gen)[:needed].tolist())


def reference_prefill_cache(s: Scenario) -> KVCache:
    """Prefill cache with random contents (identical on every prefill rank: MLA)."""
    cache = KVCache(prefill_spec(s))
    gen = torch.Generator().manual_seed(1234)
    for t in cache.k_caches + cache.v_caches:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache


def slots(s: Scenario, side: str, start: int, end: int) -> torch.Tensor:
    if side == "prefill":
        table = block_table(s.prefill_blocks, -(-s.num_tokens // s.prefill_block), 7)
        return slot_mapping(table, start, end, s.prefill_block)
    table = block_table(s.decode_blocks, -(-s.num_tokens // s.decode_block), 11)
    return slot_mapping(table, start, end, s.decode_block)


def check_received(s: Scenario, cache: KVCache) -> None:
    """Every request slot equals the prefill slot; every other slot is still zero."""
    ref = reference_prefill_cache(s)
    src, dst = slots(s, "prefill", 0, s.num_tokens), slots(s, "decode", 0, s.num_tokens)
    every = torch.arange(cache.spec.num_blocks * cache.spec.block_size)
    for layer in range(s.num_layers):
        for name, got, want in zip(("k", "v"), cache.read(layer, every), ref.read(layer, src)):
            assert torch.equal(got[dst], want), f"layer {layer} {name} differs"
            others = torch.ones(got.shape[0], dtype=torch.bool)
            others[dst] = False
            assert not got[others].any(), f"layer {layer} {name}: stray writes"


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s} s")
        time.sleep(0.01)


def wait_settled(conn: DecodeKVConnector, rid: str, timeout_s: float = 30.0) -> KVStatus:
    """Poll ``conn`` until ``rid`` is SUCCESS or FAILED; returns that status."""
    settled = (KVPoll.SUCCESS, KVPoll.FAILED)
    wait_for(lambda: conn.poll(rid).state in settled, timeout_s, f"{rid} settled")
    return conn.poll(rid)


def sent_stats(pres: list[PrefillKVConnector], rid: str, timeout_s: float = 60.0) -> list[dict]:
    """Each prefill connector's stats once it says ``rid`` is SUCCESS on its own side.

    A prefill rank counts a data record's bytes when its sender thread saw the record leave,
    which may come after the decode side's SUCCESS (the ``done`` doorbell goes out while data
    records are still in flight): stats read at the decode's SUCCESS can miss the last
    record's bytes on a loaded box.

    Raises:
        AssertionError: a prefill rank's status is not SUCCESS within ``timeout_s``.
    """
    statuses = [p.wait(rid, timeout_s) for p in pres]
    assert statuses == [KVStatus(KVPoll.SUCCESS)] * len(pres), statuses
    return [p.stats.snapshot() for p in pres]


def run_ranks(targets: list[tuple], timeout_s: float = 60.0) -> dict:
    """Start ``(fn, args)`` processes; return ``{(role, rank): (error, info)}``; kill leftovers."""
    results = CTX.Queue()
    procs = [CTX.Process(target=entry, args=(fn, args, results), daemon=True)
             for fn, args in targets]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(procs) and time.monotonic() < deadline:
            try:
                role, rank, err, info = results.get(timeout=0.5)
                out[(role, rank)] = (err, info)
            except queue.Empty:
                pass
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    return out


def entry(fn, args, results) -> None:
    torch.set_num_threads(1)
    role, rank = args[0], args[1]
    try:
        info = fn(*args)
        results.put((role, rank, None, info))
    except BaseException:  # noqa: BLE001 - report to the parent
        results.put((role, rank, traceback.format_exc(), None))


def decode_rank(role: str, rank: int, s: Scenario, addr_qs: list, barrier) -> dict:
    """Expect RID, publish the address, check partial then full arrival, slot by slot."""
    spec = decode_spec(s)
    cache = KVCache(spec)
    layout = KVLayout.from_spec(spec, "tiny-mla", s.decode_tp)
    conn = DecodeKVConnector(cache, layout, "d0", rank, TransferConfig(**s.timeouts))
    conn.expect(RID, s.num_tokens, s.prefill_tp)
    for q in addr_qs:
        q.put((rank, conn.address))
    pairs = len(build_transfer_plan(s.prefill_tp, s.decode_tp, s.num_layers).recvs_to(rank))
    wait_for(lambda: conn.stats.snapshot()["transfers"] >= pairs * (len(s.chunks) - 1), 30,
             "first chunks scattered")
    assert conn.poll(RID).state is KVPoll.TRANSFERRING, "complete before the last chunk"
    barrier.wait(30)
    status = wait_settled(conn, RID)
    assert status == KVStatus(KVPoll.SUCCESS), status
    check_received(s, cache)
    conn.release(RID)
    conn.close()
    assert_no_kv_threads()
    return conn.stats.snapshot()


def prefill_rank(role: str, rank: int, s: Scenario, addr_qs: list, barrier) -> dict:
    """Send RID in chunks (the last one after the barrier), then done; wait idle."""
    spec = prefill_spec(s)
    layout = KVLayout.from_spec(spec, "tiny-mla", s.prefill_tp)
    conn = PrefillKVConnector(reference_prefill_cache(s), layout, "p0", rank, s.prefill_tp,
                              TransferConfig(**s.timeouts))
    peers = receive_peers(addr_qs[rank], s.decode_tp)
    for i, (a, b) in enumerate(s.chunks):
        if i == len(s.chunks) - 1:
            barrier.wait(30)
        conn.send_chunk(RID, peers, a, b, slots(s, "prefill", a, b), slots(s, "decode", a, b))
    conn.finish(RID, peers, s.num_tokens)
    status = conn.wait(RID, 30)
    assert status == KVStatus(KVPoll.SUCCESS), status
    conn.close()
    assert_no_kv_threads()
    return conn.stats.snapshot()


def receive_peers(addr_q, decode_tp: int) -> list[KVPeer]:
    got = dict(addr_q.get(timeout=30) for _ in range(decode_tp))
    return [KVPeer("d0", d, *got[d]) for d in range(decode_tp)]

"""KV transfer throughput: the transfer layer vs a raw gloo send/recv (network path) and vs a
plain memcpy (same-node path) of the same bytes.

DeepSeek-V3-shaped request: 61 layers, K 512 + V 64 elements per token per layer, bf16
(1,152 B per token per layer, REFERENCE.md "KV bytes"). One prefill rank -> one decode rank,
two processes on this machine (gloo over loopback). Two block-table cases (``--cases``):
``contiguous`` (consecutive block ids on both sides, at different offsets: a fresh
allocation from an unfragmented pool) and ``random`` (random block tables on both sides: a
fragmented pool).

For each case and size the request goes in prefill chunks of ``--chunk`` tokens:
- raw: the K and V bytes of each chunk, already contiguous, sent with plain gloo send/recv
  on a separate 2-rank group as two messages per chunk (the fewest possible; no header,
  gather or scatter), into receive buffers allocated and touched outside the clock;
- net: ``PrefillKVConnector.send_chunk`` per chunk + ``finish`` with
  ``same_node="off"`` (the process-group path); the clock stops when the decode rank's
  ``poll`` said SUCCESS (reported back over the raw group);
- memcpy: one ``copy_`` of the same bytes between two contiguous tensors allocated and
  touched outside the clock, on the prefill process (one thread);
- local: as net, with ``same_node="auto"`` (both ranks on this node: the shared-memory path).
Net/local clocks run on the prefill process from a "ready" message to the decode's ack; the
same two processes do all. The pairs' set-up is excluded (a warm-up request goes first on
each). Every case ends with a byte check of the last request (prefill source rows == decode
rows). Reported: best of ``--reps`` per line, ratio = best baseline s / best kvx s,
paired = the median over repetitions of (baseline s / kvx s) of the same repetition (each
repetition runs baseline then kvx back to back: the figure least moved by other jobs), and
the kvx run's gather (prefill) / scatter (decode) seconds (0 when every message was sent /
received in place).

``--layerwise``: the kvx paths send each chunk as one record per layer (what a prefill rank
queues layer by layer during its forward, docs/kv_transfer.md "Layer by layer").

Run: PYTHONPATH=$PWD python benchmarks/kv_transfer_bench.py [--tokens 4096 16384] [--layerwise]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVLayout, KVPeer, KVPoll, PrefillKVConnector,
                         TransferConfig)
from kv_transfer import packs
from kv_transfer.backend import backend_for

LAYERS, KV_LORA, ROPE, BLOCK = 61, 512, 64, 128
MODEL = "deepseek-v3-shape"
PATHS = {"net": "off", "local": "auto"}  # kvx path -> TransferConfig.same_node


def spec(max_tokens: int, dtype: torch.dtype) -> KVCacheSpec:
    blocks = 2 * (-(-max_tokens // BLOCK))  # twice the request: block tables are scattered
    return KVCacheSpec(LAYERS, blocks, BLOCK, KV_LORA, ROPE, dtype)


def table_slots(num_blocks: int, tokens: int, seed: int, case: str) -> torch.Tensor:
    """Slots of a ``tokens`` request: ``contiguous`` = consecutive block ids (a fresh
    allocation from an unfragmented pool; prefill and decode at different offsets),
    ``random`` = a random block table (fragmented pool)."""
    need = -(-tokens // BLOCK)
    if case == "contiguous":
        first = seed * (num_blocks - need) // 3
        table = list(range(first, first + need))
    else:
        gen = torch.Generator().manual_seed(seed)
        table = torch.randperm(num_blocks, generator=gen)[:need].tolist()
    return slot_mapping(table, 0, tokens, BLOCK)


def raw_group(rank: int, port_q, timeout_s: float = 60.0) -> dist.ProcessGroup:
    if rank == 1:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        port_q.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", port_q.get(timeout=timeout_s), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    group = backend_for("cpu").make_group(dist.PrefixStore("raw", store), rank, timeout_s,
                                          "127.0.0.1")
    return group, store


WAIT = datetime.timedelta(seconds=120)  # every wait of the benchmark is bounded


def signal(group, rank: int) -> None:
    group.send([torch.ones(1, dtype=torch.uint8)], 1 - rank, 1).wait(WAIT)


def wait_signal(group, rank: int) -> None:
    group.recv([torch.zeros(1, dtype=torch.uint8)], 1 - rank, 1).wait(WAIT)


def warm_up(conn, peers: list[KVPeer] | None, rank: int) -> None:
    """One small request through the connector before any clock runs: the pair's
    rendezvous and group set-up are not part of a transfer's time."""
    if peers is None:  # decode
        conn.expect("warm-up", BLOCK, 1)
        deadline = time.monotonic() + 60
        while (status := conn.poll("warm-up")).state is not KVPoll.SUCCESS:
            if status.state is KVPoll.FAILED or time.monotonic() > deadline:
                raise RuntimeError(f"warm-up failed: {status}")
            time.sleep(0.001)
        conn.release("warm-up")
        return
    slots = torch.arange(BLOCK)
    conn.send_chunk("warm-up", peers, 0, BLOCK, slots, slots)
    conn.finish("warm-up", peers, BLOCK)
    if (status := conn.wait("warm-up", 60)).state is not KVPoll.SUCCESS:
        raise RuntimeError(f"warm-up failed: {status}")


def decode_main(args, port_q, addr_q, out_q) -> None:
    packs.PACK_BYTES = int(args.pack_mib * 2**20)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    cache = KVCache(spec(max(args.tokens), dtype))
    layout = KVLayout.from_spec(cache.spec, MODEL, 1)
    conns = {path: DecodeKVConnector(cache, layout, f"d-{path}", 0,
                                     TransferConfig(same_node=same))
             for path, same in PATHS.items()}
    addr_q.put({path: conn.address for path, conn in conns.items()})
    group, _store = raw_group(1, port_q)
    check, scatter_s = {}, {}
    for conn in conns.values():
        warm_up(conn, None, 1)
    for case, tokens in [(c, t) for c in args.cases for t in args.tokens]:
        chunks = [(a, min(a + args.chunk, tokens)) for a in range(0, tokens, args.chunk)]
        # NOTE: raw receive buffers are allocated and touched once, outside the clock: the
        # baseline is the wire alone.
        bufs = [(torch.zeros(LAYERS, b - a, KV_LORA, dtype=dtype),
                 torch.zeros(LAYERS, b - a, ROPE, dtype=dtype)) for a, b in chunks]
        for rep in range(args.reps):
            signal(group, 1)
            for k, v in bufs:  # raw
                for t in (k, v):
                    group.recv([t], 0, 0).wait(WAIT)
            signal(group, 1)
            for path, conn in conns.items():
                scatter_s[(path, case, tokens, rep)] = receive(conn, group, f"r{path}{case}"
                                                               f"{tokens}-{rep}", tokens)
        del bufs
        dst = table_slots(cache.spec.num_blocks, tokens, 2, case)
        check[case] = torch.cat([cache.read(LAYERS - 1, dst[-64:])[0],
                                 cache.read(0, dst[:64])[1]], 1)
    out_q.put(("decode", scatter_s, check))
    for conn in conns.values():
        conn.close()


def receive(conn, group, rid: str, tokens: int) -> float:
    """Decode side of one timed request; returns its scatter seconds."""
    conn.expect(rid, tokens, 1)
    before = conn.stats.snapshot()["scatter_s"]
    signal(group, 1)
    while (status := conn.poll(rid)).state is not KVPoll.SUCCESS:
        if status.state is KVPoll.FAILED:
            raise RuntimeError(status.error)
        time.sleep(0.0005)
    signal(group, 1)
    conn.release(rid)
    return conn.stats.snapshot()["scatter_s"] - before


def prefill_main(args, port_q, addr_q, out_q) -> None:
    packs.PACK_BYTES = int(args.pack_mib * 2**20)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    cache = KVCache(spec(max(args.tokens), dtype))
    for t in cache.k_caches + cache.v_caches:
        t.uniform_()
    layout = KVLayout.from_spec(cache.spec, MODEL, 1)
    conns = {path: PrefillKVConnector(cache, layout, f"p-{path}", 0, 1,
                                      TransferConfig(same_node=same))
             for path, same in PATHS.items()}
    addrs = addr_q.get(timeout=60)
    peers = {path: [KVPeer(f"d-{path}", 0, *addrs[path])] for path in PATHS}
    group, _store = raw_group(0, port_q)
    results, check = [], {}
    for path, conn in conns.items():
        warm_up(conn, peers[path], 0)
    for case, tokens in [(c, t) for c in args.cases for t in args.tokens]:
        src = table_slots(cache.spec.num_blocks, tokens, 1, case)
        dst = table_slots(cache.spec.num_blocks, tokens, 2, case)
        chunks = [(a, min(a + args.chunk, tokens)) for a in range(0, tokens, args.chunk)]
        for rep in range(args.reps):
            bufs = [(torch.stack([cache.read(i, src[a:b])[0] for i in range(LAYERS)]),
                     torch.stack([cache.read(i, src[a:b])[1] for i in range(LAYERS)]))
                    for a, b in chunks]
            wait_signal(group, 0)
            t0 = time.perf_counter()
            works = [group.send([t], 1, 0) for k, v in bufs for t in (k, v)]
            for w in works:
                w.wait(WAIT)
            wait_signal(group, 0)
            raw_s = time.perf_counter() - t0
            memcpy_s = memcpy_time(bufs)
            del bufs, works
            row = {"raw": raw_s, "memcpy": memcpy_s}
            for path, conn in conns.items():
                row[path] = send(conn, group, peers[path], f"r{path}{case}{tokens}-{rep}",
                                 chunks, src, dst, args.layerwise)
            results.append((case, tokens, rep, row))
        check[case] = torch.cat([cache.read(LAYERS - 1, src[-64:])[0],
                                 cache.read(0, src[:64])[1]], 1)
    out_q.put(("prefill", results, check))
    for conn in conns.values():
        conn.close()


def memcpy_time(bufs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Seconds of one plain ``copy_`` of every payload into a pre-touched copy (one thread)."""
    outs = [(k.clone(), v.clone()) for k, v in bufs]
    t0 = time.perf_counter()
    for (k, v), (ok, ov) in zip(bufs, outs):
        ok.copy_(k)
        ov.copy_(v)
    return time.perf_counter() - t0


def send(conn, group, peers, rid: str, chunks, src, dst,
         layerwise: bool = False) -> tuple[float, float]:
    """Prefill side of one timed request: (seconds to complete on decode, gather seconds).
    ``layerwise``: one record per layer of each chunk, as the prefill forward queues them."""
    before = conn.stats.snapshot()["gather_s"]
    wait_signal(group, 0)
    t0 = time.perf_counter()
    for a, b in chunks:
        for layers in ([(i,) for i in range(LAYERS)] if layerwise else [None]):
            conn.send_chunk(rid, peers, a, b, src[a:b], dst[a:b], layers=layers)
    conn.finish(rid, peers, chunks[-1][1])
    wait_signal(group, 0)
    kvx_s = time.perf_counter() - t0
    if (status := conn.wait(rid, 60)).state is not KVPoll.SUCCESS:
        raise RuntimeError(f"request {rid}: {status}")
    return kvx_s, conn.stats.snapshot()["gather_s"] - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk, tokens")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pack-mib", type=float, default=packs.PACK_BYTES / 2**20,
                        help="kv_transfer.packs.PACK_BYTES, MiB")
    parser.add_argument("--cases", nargs="+", default=["contiguous", "random"],
                        choices=["contiguous", "random"], help="block-table cases")
    parser.add_argument("--layerwise", action="store_true",
                        help="kvx sends one record per layer of each chunk (layer by layer)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    port_q, addr_q, out_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=f, args=(args, port_q, addr_q, out_q))
             for f in (decode_main, prefill_main)]
    for p in procs:
        p.start()
    try:
        got = dict((role, rest) for role, *rest in (out_q.get(timeout=300) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for case in args.cases:
        assert torch.equal(got["decode"][1][case], got["prefill"][1][case]), \
            f"bytes differ after transfer ({case} block tables)"
    report(args, got["prefill"][0], got["decode"][0])


def report(args, results, scatter_s) -> None:
    """One line per (path, case, size): best baseline and best kvx of the repetitions, and
    the kvx run's gather (prefill) and scatter (decode) seconds."""
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    print(f"DeepSeek-V3 shape: {LAYERS} layers x ({KV_LORA} + {ROPE}) x {elem} B per token, "
          f"chunk {args.chunk} tokens, packs {args.pack_mib:g} MiB, "
          f"{'one record per layer of a chunk' if args.layerwise else 'one record per chunk'}, "
          f"P1 -> D1 on this node, best of {args.reps}; "
          "net = process group (gloo loopback) vs raw gloo, local = shared memory vs memcpy")
    print(f"{'path':>5} {'case':>10} {'tokens':>7} {'MiB':>8} {'base':>6} {'base GB/s':>9} "
          f"{'kvx GB/s':>9} {'ratio':>6} {'paired':>7} {'gather s':>9} {'scatter s':>10}")
    for path, base in (("net", "raw"), ("local", "memcpy")):
        for case, tokens in [(c, t) for c in args.cases for t in args.tokens]:
            runs = [r for r in results if r[:2] == (case, tokens)]
            base_s = min(r[3][base] for r in runs)
            _, _, rep, row = min(runs, key=lambda r: r[3][path][0])
            kvx_s, gather_s = row[path]
            paired = statistics.median(r[3][base] / r[3][path][0] for r in runs)
            nbytes = tokens * LAYERS * (KV_LORA + ROPE) * elem
            print(f"{path:>5} {case:>10} {tokens:>7} {nbytes / 2**20:>8.1f} {base:>6} "
                  f"{nbytes / base_s / 1e9:>9.2f} {nbytes / kvx_s / 1e9:>9.2f} "
                  f"{base_s / kvx_s:>6.2f} {paired:>7.2f} {gather_s:>9.3f} "
                  f"{scatter_s[(path, case, tokens, rep)]:>10.3f}")


if __name__ == "__main__":
    main()

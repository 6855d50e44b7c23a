"""Packs (layer groups x token ranges), and transfers through every path: direct (cache views
both sides), packed over the network, packed through the same-node segment; exact bytes,
nothing written outside the request, the segment's file gone once the pair is up."""

import dataclasses
import glob
import time

import pytest
import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVChunk, KVLayout, KVPeer, KVPoll, KVStatus,
                         PrefillKVConnector, TransferConfig)
from kv_transfer import local, packs, payload, wire
from kv_transfer.chunk import runs

CFG = dict(connect_timeout_s=30, header_timeout_s=30, payload_timeout_s=30,
           completion_timeout_s=60)


def _header(layers, n):
    return wire.data_header(KVChunk("r", tuple(layers), 0, n, torch.arange(n)), 0, "f")


def test_packs_group_layers_and_cut_tokens():
    layout = KVLayout.from_spec(KVCacheSpec(num_layers=5, num_blocks=4, block_size=4,
                                            kv_lora_rank=16, qk_rope_head_dim=4), "m", 1)
    per_token = (16 + 4) * layout.element_size  # bytes per token per layer, all buffers
    assert packs.token_bytes(layout, _header(range(5), 1).chunk) == [64, 16]
    # 10 tokens x 80 B = 800 B per layer: 2 layers per 1,700 B pack, the last one alone
    got = packs.packs(layout, _header(range(5), 10), limit=1700)
    assert [(p.layers, p.a, p.b, p.nbytes) for p in got] == [
        ((0, 1), 0, 10, 1600), ((2, 3), 0, 10, 1600), ((4,), 0, 10, 800)]
    # a layer larger than a pack: token ranges of 4 tokens, layer after layer
    got = packs.packs(layout, _header((1, 3), 10), limit=4 * per_token + 5)
    assert [(p.layers, p.a, p.b) for p in got] == [((1,), 0, 4), ((1,), 4, 8), ((1,), 8, 10),
                                                   ((3,), 0, 4), ((3,), 4, 8), ((3,), 8, 10)]
    with pytest.raises(ValueError, match="PACK_BYTES"):
        packs.packs(layout, _header((0,), 2), limit=per_token - 1)
    assert runs(torch.arange(5, 12)) == [range(0, 7)]
    assert runs(torch.tensor([3])) == [range(0, 1)]
    assert runs(torch.tensor([8, 9, 10, 4, 5, 20])) == [range(0, 3), range(3, 5), range(5, 6)]
    # a cut wherever either side breaks its run
    assert runs(torch.tensor([0, 1, 2, 3, 9, 10]), torch.tensor([4, 5, 8, 9, 10, 11])) \
        == [range(0, 2), range(2, 4), range(4, 6)]


def _wait_complete(dec, rid: str, timeout_s: float = 30) -> None:
    """Wait (bounded) until decode connector ``dec`` has every byte of ``rid``."""
    deadline = time.monotonic() + timeout_s
    while (status := dec.poll(rid)).state is not KVPoll.SUCCESS:
        assert status.state is not KVPoll.FAILED, status
        assert time.monotonic() < deadline, "transfer not complete in time"
        time.sleep(0.005)


def _transfer(spec_p, spec_d, src_blocks, dst_blocks, tokens, chunk, same_node):
    """Send ``tokens`` in chunks P1 -> D1 in one process; returns both caches and slots."""
    cfg = TransferConfig(**CFG, same_node=same_node)
    p_cache, d_cache = KVCache(spec_p), KVCache(spec_d)
    for t in p_cache.k_caches + p_cache.v_caches:
        t.copy_(torch.randn(t.shape))
    dec = DecodeKVConnector(d_cache, KVLayout.from_spec(spec_d, "m", 1), "d0", 0, cfg)
    pre = PrefillKVConnector(p_cache, KVLayout.from_spec(spec_p, "m", 1), "p0", 0, 1, cfg)
    peers = [KVPeer("d0", 0, *dec.address)]
    src = slot_mapping(src_blocks, 0, tokens, spec_p.block_size)
    dst = slot_mapping(dst_blocks, 0, tokens, spec_d.block_size)
    segments = []
    try:
        dec.expect("r", tokens, prefill_tp=1)
        for a in range(0, tokens, chunk):
            b = min(a + chunk, tokens)
            pre.send_chunk("r", peers, a, b, src[a:b], dst[a:b])
        pre.finish("r", peers, tokens)
        segments.append(glob.glob(f"{local.SHM_DIR}/orch-kv-*"))
        assert pre.wait("r", 30) == KVStatus(KVPoll.SUCCESS)
        _wait_complete(dec, "r")
        dec.release("r")
        stats = (pre.stats.snapshot(), dec.stats.snapshot())
    finally:
        pre.close()
        dec.close()
    return p_cache, d_cache, src, dst, stats, segments[0]


def _check_bytes(p_cache, d_cache, src, dst):
    every = torch.arange(d_cache.spec.num_blocks * d_cache.spec.block_size)
    written = torch.zeros(every.numel(), dtype=torch.bool)
    written[dst] = True
    for layer in range(len(p_cache.k_caches)):
        for got, want in zip(d_cache.read(layer, every), p_cache.read(layer, src)):
            assert torch.equal(got[dst], want)
            assert not got[~written].any(), "bytes written outside the request"


@pytest.mark.parametrize("same_node", ["off", "auto"])
@pytest.mark.parametrize("name,src_blocks,dst_blocks,block_p,block_d", [
    ("contiguous", (2, 3, 4, 5), (1, 2, 3, 4), 8, 8),  # direct over the network
    ("random", (7, 2, 5, 0), (3, 6, 1, 4), 8, 8),
    ("misaligned", (7, 2, 5, 0, 9, 11, 1, 3), (3, 1, 6, 0), 4, 8),  # block sizes differ
])
def test_transfer_paths_move_exact_bytes(monkeypatch, name, src_blocks, dst_blocks, block_p,
                                         block_d, same_node):
    torch.set_num_threads(1)
    # same node: 3-token chunks x 3 layers x 80 B per token: one pack per record (10
    # records); network: 12-token chunks, the segment
    # holds PACK_DEPTH = 4 packs: slots are reused across records
    monkeypatch.setattr(packs, "PACK_BYTES", 2000)
    # K runs (8 tokens x 64 B) are scattered per run, V runs (8 x 16 B) with index_copy_;
    # network pairs send K runs (>= 4 tokens x 64 B) as cache views, V in packs
    monkeypatch.setattr(packs, "RUN_COPY_BYTES", 256)
    monkeypatch.setattr(packs, "MIN_RUN_BYTES", 256)
    chosen = _spy_views(monkeypatch)
    spec_p = KVCacheSpec(num_layers=3, num_blocks=12, block_size=block_p, kv_lora_rank=16,
                         qk_rope_head_dim=4)
    spec_d = KVCacheSpec(num_layers=3, num_blocks=8, block_size=block_d, kv_lora_rank=16,
                         qk_rope_head_dim=4)
    before = set(glob.glob(f"{local.SHM_DIR}/orch-kv-*"))
    made = _spy_segments(monkeypatch)
    p_cache, d_cache, src, dst, (sent, got), during = _transfer(
        spec_p, spec_d, src_blocks, dst_blocks, 30, chunk=3 if same_node == "auto" else 12,
        same_node=same_node)
    _check_bytes(p_cache, d_cache, src, dst)
    assert sent["bytes"] == got["bytes"] == 30 * 3 * (16 + 4) * 4
    assert sent["transfers"] == got["transfers"] == (10 if same_node == "auto" else 3)
    packed = same_node == "auto" or name != "contiguous"
    assert (sent["gather_s"] > 0) == packed, f"{name}: gather use"
    assert (got["scatter_s"] > 0) == packed, f"{name}: scatter use"
    # records [0, 12) [12, 24) [24, 30): 1 cut -> every buffer; 2 or 3 cuts (8-token blocks
    # both sides, or 4 / 8 tokens) -> K if its runs average >= 256 B
    views = {"off": {"contiguous": {(0, 1)}, "random": {(0,), (0, 1)},
                     "misaligned": {(0,), ()}},
             "auto": dict.fromkeys(("contiguous", "random", "misaligned"), {()})}
    assert set(chosen) == views[same_node][name], "buffers sent as cache views"
    assert made == ([packs.segment_bytes()] if same_node == "auto" else [])
    assert set(during) <= before, "the segment file outlived the pair set-up"


def _spy_views(monkeypatch) -> list[tuple[int, ...]]:
    """The view buffers the sender chooses for each data record from now on."""
    chosen, plan = [], packs.plan_views
    monkeypatch.setattr(packs, "plan_views", lambda *a: chosen.append(plan(*a).views) or
                        plan(*a))
    return chosen


def _spy_segments(monkeypatch) -> list[int]:
    """Sizes of the same-node segments made from now on."""
    made, create = [], local._shm_create
    monkeypatch.setattr(local, "_shm_create", lambda n, d: made.append(n) or create(n, d))
    return made


def test_same_node_needs_one_node(monkeypatch):
    """A peer on another node (other node id) gets no segment: the network path."""
    torch.set_num_threads(1)
    spec = KVCacheSpec(num_layers=2, num_blocks=4, block_size=4, kv_lora_rank=8,
                       qk_rope_head_dim=4)
    ids = iter(["node-a", "node-b"])
    monkeypatch.setattr(local, "node_id", lambda: next(ids))  # prefill asks, decode compares
    made = _spy_segments(monkeypatch)
    p_cache, d_cache, src, dst, (sent, got), _ = _transfer(spec, spec, (2, 0), (1, 3), 8,
                                                           chunk=8, same_node="auto")
    _check_bytes(p_cache, d_cache, src, dst)
    assert got["transfers"] == 1 and made == []


def test_stale_segments_of_dead_decode_ranks_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "SHM_DIR", str(tmp_path))
    dead = tmp_path / "orch-kv-999999999-ab"
    live = tmp_path / "orch-kv-1-cd"  # pid 1 runs
    for f in (dead, live):
        f.write_bytes(b"x")
    assert local.remove_stale() == [str(dead)]
    assert not dead.exists() and live.exists()


def test_a_handle_that_is_not_a_segment_is_neither_mapped_nor_unlinked(tmp_path, monkeypatch):
    """The prefill rank unlinks the handle of a decode ack even when it does not map: a
    handle naming any other file must leave that file alone."""
    monkeypatch.setattr(local, "SHM_DIR", str(tmp_path / "shm"))
    victim = tmp_path / "orch-kv-1-victim"  # right name, wrong folder
    victim.write_bytes(b"x" * 64)
    backend = local.local_backend("cpu")
    with pytest.raises(OSError, match="not a KV segment path"):
        backend.open(str(victim).encode(), 64, torch.device("cpu"))
    backend.unlink(str(victim).encode())
    assert victim.exists()


def test_a_link_named_like_a_segment_is_not_mapped(tmp_path, monkeypatch):
    monkeypatch.setattr(local, "SHM_DIR", str(tmp_path))
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 64)
    link = tmp_path / "orch-kv-1-link"
    link.symlink_to(target)
    with pytest.raises(OSError, match="not a regular file"):
        local.local_backend("cpu").open(str(link).encode(), 64, torch.device("cpu"))
    assert target.read_bytes() == b"x" * 64


def test_scatter_of_a_pack_buffer_that_starts_mid_word():
    """2-byte elements are scattered as int32 words where the rows allow it; V follows K in a
    pack, so with 1 layer x 3 tokens x an odd K width (5) V starts at an odd element: it must
    still land (before: 'storage_offset() must be divisible by 2', the request failed)."""
    spec = KVCacheSpec(num_layers=1, num_blocks=2, block_size=4, kv_lora_rank=5,
                       qk_rope_head_dim=2, dtype=torch.bfloat16)
    cache = KVCache(spec)
    pack = torch.randn(3 * 5 + 3 * 2).to(torch.bfloat16)
    v = pack[3 * 5:].view(1, 3, 2)
    assert v.storage_offset() % 2 == 1
    slots = torch.tensor([6, 1, 4])
    payload.scatter(cache, 1, (0,), None, slots, v)
    assert torch.equal(cache.read(0, slots)[1], v[0])


def test_views_of_records_with_some_of_the_layers(monkeypatch):
    """P2 -> D1: each prefill rank's records carry some of the layers (layer sharding: layers
    0-1 from rank 0, layer 2 from rank 1), each buffer of V3.2's three as views, one
    ``[n, width]`` message per (buffer, layer, run); chunk edges inside blocks. Exact bytes,
    nothing written outside the request."""
    torch.set_num_threads(1)
    monkeypatch.setattr(packs, "MIN_RUN_BYTES", 1)  # every buffer as views
    chosen = _spy_views(monkeypatch)
    spec_p, spec_d = (KVCacheSpec(num_layers=3, num_blocks=n, block_size=4, kv_lora_rank=16,
                                  qk_rope_head_dim=4, index_head_dim=8) for n in (10, 8))
    ref = KVCache(spec_p)
    for layer in range(3):
        for t in ref.flat_buffers(layer):
            t.copy_(torch.randn(t.shape))
    p_caches, d_cache = [KVCache(spec_p) for _ in range(2)], KVCache(spec_d)
    for cache in p_caches:
        for layer in range(3):
            for t, want in zip(cache.flat_buffers(layer), ref.flat_buffers(layer)):
                t.copy_(want)
    cfg = TransferConfig(**CFG, same_node="off")
    dec = DecodeKVConnector(d_cache, KVLayout.from_spec(spec_d, "m", 1), "d0", 0, cfg)
    pres = [PrefillKVConnector(p_caches[r], KVLayout.from_spec(spec_p, "m", 2), "p0", r, 2, cfg)
            for r in range(2)]
    peers = [KVPeer("d0", 0, *dec.address)]
    src, dst = slot_mapping((5, 1, 7, 2, 9), 0, 18, 4), slot_mapping((3, 6, 0, 7, 1), 0, 18, 4)
    try:
        dec.expect("r", 18, prefill_tp=2)
        for a, b in ((0, 3), (3, 13), (13, 18)):
            for pre in pres:
                pre.send_chunk("r", peers, a, b, src[a:b], dst[a:b])
        for pre in pres:
            pre.finish("r", peers, 18)
            assert pre.wait("r", 30) == KVStatus(KVPoll.SUCCESS)
        _wait_complete(dec, "r")
        sent = [pre.stats.snapshot() for pre in pres]
    finally:
        for pre in pres:
            pre.close()
        dec.close()
    _check_bytes(ref, d_cache, src, dst)
    assert chosen == [(0, 1, 2)] * 6, chosen  # 3 records per rank, every buffer as views
    assert [s["gather_s"] for s in sent] == [0.0, 0.0], "nothing packed"
    assert [s["bytes"] for s in sent] == [18 * n * (16 + 4 + 8) * 4 for n in (2, 1)]


def test_view_messages_are_the_cache_rows_of_each_cut_and_refuse_a_cut_that_splits_no_run():
    """The receiver's views of a record: per (buffer, layer, cut) the rows of its own slots;
    cuts that leave a break of those slots inside one message break the protocol."""
    spec = KVCacheSpec(num_layers=2, num_blocks=4, block_size=4, kv_lora_rank=3,
                       qk_rope_head_dim=2)
    cache = KVCache(spec)
    for layer in range(2):
        for t in cache.flat_buffers(layer):
            t.copy_(torch.randn(t.shape))
    slots = torch.tensor([9, 10, 2, 3])
    chunk = KVChunk("r", (1,), 0, 4, slots)
    header = dataclasses.replace(wire.data_header(chunk, 0, "f"), views=(0, 1), cuts=(0, 2))
    got = packs.cut_views(cache, KVLayout.from_spec(spec, "m", 1), header, None, slots)
    want = [cache.flat_buffers(1)[b][s:s + 2] for b in (0, 1) for s in (9, 2)]
    assert len(got) == 4 and all(g.data_ptr() == w.data_ptr() and torch.equal(g, w)
                                 for g, w in zip(got, want))
    with pytest.raises(ValueError, match="split no run"):
        packs.cut_views(cache, KVLayout.from_spec(spec, "m", 1),
                        dataclasses.replace(header, cuts=(0,)), None, slots)

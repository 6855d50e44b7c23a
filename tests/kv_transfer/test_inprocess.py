"""Connectors of both sides in one process (threads, gloo over loopback): abort, dropped
records of unknown requests, GQA head regrouping, thread hygiene."""

import time
from types import SimpleNamespace

import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVLayout, KVPeer, KVPoll, KVStatus,
                         PrefillKVConnector, TransferConfig, build_transfer_plan)
from kv_transfer.layout import rank_heads

from .cluster import sent_stats, wait_settled
from tests.leaks import assert_no_kv_threads, kv_threads

# NOTE: happy-path tests: generous bounds (2 shared cores, up to 48 threads in one process)
CFG = TransferConfig(connect_timeout_s=30, header_timeout_s=30, payload_timeout_s=30,
                     completion_timeout_s=60)
SPEC_P = KVCacheSpec(num_layers=2, num_blocks=16, block_size=4, kv_lora_rank=8,
                     qk_rope_head_dim=4)
SPEC_D = KVCacheSpec(num_layers=2, num_blocks=8, block_size=8, kv_lora_rank=8,
                     qk_rope_head_dim=4)


def _wait(pred, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_abort_and_unknown_requests_never_write():
    before = kv_threads()
    p_cache = KVCache(SPEC_P)
    for t in p_cache.k_caches + p_cache.v_caches:
        t.copy_(torch.randn(t.shape))
    d_cache = KVCache(SPEC_D)
    dec = DecodeKVConnector(d_cache, KVLayout.from_spec(SPEC_D, "m", 1), "d0", 0, CFG)
    pre = PrefillKVConnector(p_cache, KVLayout.from_spec(SPEC_P, "m", 1), "p0", 0, 1, CFG)
    peers = [KVPeer("d0", 0, *dec.address)]
    src = slot_mapping((3, 9, 1), 0, 12, 4)
    try:
        # unknown request: read and dropped (decode never expected it)
        pre.send_chunk("ghost", peers, 0, 8, src[:8], slot_mapping((5,), 0, 8, 8))
        pre.finish("ghost", peers, 8)
        assert pre.wait("ghost", 10) == KVStatus(KVPoll.SUCCESS)  # sent, and dropped there
        # aborted request: first chunk lands, then abort; later bytes never land
        dec.expect("a", 12, prefill_tp=1)
        dst = slot_mapping((2, 6), 0, 12, 8)
        pre.send_chunk("a", peers, 0, 8, src[:8], dst[:8])
        _wait(lambda: dec.stats.snapshot()["transfers"] == 1)
        pre.abort("a", peers, reason="client cancelled")
        pre.send_chunk("a", peers, 8, 12, src[8:], dst[8:])  # raced with abort: ignored
        pre.finish("a", peers, 12)  # ignored too
        # NOTE: an abort is not a transfer failure on the prefill side
        assert pre.wait("a", 10) == KVStatus(KVPoll.ABORTED, "client cancelled")
        got = wait_settled(dec, "a")
        assert got.state is KVPoll.FAILED and "client cancelled" in got.error, got
        dec.release("a")
        written = torch.zeros(SPEC_D.num_blocks * SPEC_D.block_size, dtype=torch.bool)
        written[dst[:8]] = True
        for layer in range(2):
            assert torch.equal(d_cache.flat_k(layer)[dst[:8]], p_cache.flat_k(layer)[src[:8]])
            assert not d_cache.flat_k(layer)[~written].any(), "ghost or aborted bytes written"
            assert not d_cache.flat_v(layer)[~written].any()
        assert dec.stats.snapshot()["transfers"] == 1
    finally:
        pre.close()
        dec.close()
    assert_no_kv_threads(before)


class _GQACache(SimpleNamespace):
    """Duck-typed GQA cache: per layer K/V ``[num_blocks, block_size, local heads, head_dim]``."""

    def layer_buffers(self, layer):
        """K and V of ``layer``, ``[num_blocks, block_size, local heads, head_dim]``."""
        return self.k_caches[layer], self.v_caches[layer]


def _gqa_caches(tp, heads, reference=None, blocks=16, bs=4, layers=3, hd=4):
    caches = []
    for rank in range(tp):
        mine = rank_heads(tp, heads, rank)
        if reference is None:
            k = [torch.zeros(blocks, bs, len(mine), hd) for _ in range(layers)]
            v = [torch.zeros(blocks, bs, len(mine), hd) for _ in range(layers)]
        else:
            k = [reference[0][i][:, :, mine.start:mine.stop].clone() for i in range(layers)]
            v = [reference[1][i][:, :, mine.start:mine.stop].clone() for i in range(layers)]
        caches.append(_GQACache(k_caches=k, v_caches=v))
    return caches


def test_gqa_heads_are_regrouped_p2_to_d4():
    heads, layers, p_tp, d_tp, n = 8, 3, 2, 4, 10
    gen = torch.Generator().manual_seed(0)
    ref = ([torch.randn(16, 4, heads, 4, generator=gen) for _ in range(layers)],
           [torch.randn(16, 4, heads, 4, generator=gen) for _ in range(layers)])
    p_caches = _gqa_caches(p_tp, heads, ref)
    d_caches = _gqa_caches(d_tp, heads)
    lay = lambda tp: KVLayout.gqa("g", layers, 4, heads, 4, torch.float32, tp)  # noqa: E731
    decs = [DecodeKVConnector(d_caches[d], lay(d_tp), "d0", d, CFG) for d in range(d_tp)]
    pres = [PrefillKVConnector(p_caches[p], lay(p_tp), "p0", p, p_tp, CFG) for p in range(p_tp)]
    peers = [KVPeer("d0", d, *decs[d].address) for d in range(d_tp)]
    src, dst = slot_mapping((7, 2, 11), 0, n, 4), slot_mapping((5, 0, 9), 0, n, 4)
    try:
        for dec in decs:
            dec.expect("g", n, prefill_tp=p_tp)
        for pre in pres:
            pre.send_chunk("g", peers, 0, 6, src[:6], dst[:6])
            pre.send_chunk("g", peers, 6, n, src[6:], dst[6:])
            pre.finish("g", peers, n)
        settled = [wait_settled(d, "g") for d in decs]
        assert settled == [KVStatus(KVPoll.SUCCESS)] * len(decs), settled
        for d, dec in enumerate(decs):
            mine = rank_heads(d_tp, heads, d)
            for i in range(layers):
                for got, want in ((d_caches[d].k_caches[i], ref[0][i]),
                                  (d_caches[d].v_caches[i], ref[1][i])):
                    flat_got = got.flatten(0, 1)[dst]
                    flat_want = want.flatten(0, 1)[src][:, mine.start:mine.stop]
                    assert torch.equal(flat_got, flat_want), (d, i)
        plan = build_transfer_plan(p_tp, d_tp, layers, "gqa", heads)
        sent = sum(s["bytes"] for s in sent_stats(pres, "g"))
        assert sent == sum(len(pp.layers) * len(pp.heads) for pp in plan.pairs) * n * 4 * 4 * 2
    finally:
        for c in pres + decs:
            c.close()


def test_one_dead_pair_does_not_affect_another():
    """Two prefill instances feed one decode rank; one goes away mid-request: its request
    fails by the completion deadline, the other pair's request completes."""
    # NOTE: the deadline under test runs from expect(): both pairs are set up by a warm-up
    # request first, so a loaded machine's slow pair set-up cannot spend it (it once failed
    # A and B alike before their first records arrived)
    cfg = TransferConfig(connect_timeout_s=30, header_timeout_s=30, payload_timeout_s=30,
                         completion_timeout_s=8)
    p_cache = KVCache(SPEC_P)
    for t in p_cache.k_caches + p_cache.v_caches:
        t.copy_(torch.randn(t.shape))
    d_cache = KVCache(SPEC_D)
    dec = DecodeKVConnector(d_cache, KVLayout.from_spec(SPEC_D, "m", 1), "d0", 0, cfg)
    pa, pb = (PrefillKVConnector(p_cache, KVLayout.from_spec(SPEC_P, "m", 1), name, 0, 1, cfg)
              for name in ("pa", "pb"))
    peers = [KVPeer("d0", 0, *dec.address)]
    src = slot_mapping((3, 9), 0, 8, 4)
    dst_a, dst_b = slot_mapping((1,), 0, 8, 8), slot_mapping((4,), 0, 8, 8)
    try:
        for warm, conn, dst in (("warm-a", pa, dst_a), ("warm-b", pb, dst_b)):
            dec.expect(warm, 8, prefill_tp=1)
            conn.send_chunk(warm, peers, 0, 8, src, dst)
            conn.finish(warm, peers, 8)
        assert [wait_settled(dec, w, 60) for w in ("warm-a", "warm-b")] == \
            [KVStatus(KVPoll.SUCCESS)] * 2
        for warm in ("warm-a", "warm-b"):
            dec.release(warm)
        sent = dec.stats.snapshot()["transfers"]
        dec.expect("A", 8, prefill_tp=1)
        dec.expect("B", 8, prefill_tp=1)
        pa.send_chunk("A", peers, 0, 4, src[:4], dst_a[:4])
        pb.send_chunk("B", peers, 0, 4, src[:4], dst_b[:4])
        _wait(lambda: dec.stats.snapshot()["transfers"] == sent + 2)
        pa.close()  # prefill instance pa is gone
        pb.send_chunk("B", peers, 4, 8, src[4:], dst_b[4:])
        pb.finish("B", peers, 8)
        assert wait_settled(dec, "B") == KVStatus(KVPoll.SUCCESS)
        assert torch.equal(d_cache.flat_k(1)[dst_b], p_cache.flat_k(1)[src])
        got = wait_settled(dec, "A", 30)
        assert got.state is KVPoll.FAILED and "completion_timeout_s" in got.error, got
        assert dec.poll("B") == KVStatus(KVPoll.SUCCESS)
    finally:
        pb.close()
        dec.close()


def test_non_divisible_p3_to_d2_mla():
    """Layer sharding with uneven runs (P3->D2, 5 layers): every decode rank gets every layer
    of every token, from the prefill ranks the plan names."""
    spec_p = KVCacheSpec(num_layers=5, num_blocks=8, block_size=4, kv_lora_rank=8,
                         qk_rope_head_dim=4)
    spec_d = KVCacheSpec(num_layers=5, num_blocks=4, block_size=8, kv_lora_rank=8,
                         qk_rope_head_dim=4)
    ref = KVCache(spec_p)
    for t in ref.k_caches + ref.v_caches:
        t.copy_(torch.randn(t.shape))
    d_caches = [KVCache(spec_d) for _ in range(2)]
    decs = [DecodeKVConnector(d_caches[d], KVLayout.from_spec(spec_d, "m", 2), "d0", d, CFG)
            for d in range(2)]
    pres = [PrefillKVConnector(ref, KVLayout.from_spec(spec_p, "m", 3), "p0", p, 3, CFG)
            for p in range(3)]  # NOTE: MLA ranks hold identical caches; share one here
    peers = [KVPeer("d0", d, *decs[d].address) for d in range(2)]
    src, dst = slot_mapping((6, 1, 4), 0, 11, 4), slot_mapping((3, 0), 0, 11, 8)
    try:
        for dec in decs:
            dec.expect("r", 11, prefill_tp=3)
        for pre in pres:
            pre.send_chunk("r", peers, 0, 7, src[:7], dst[:7])
            pre.send_chunk("r", peers, 7, 11, src[7:], dst[7:])
            pre.finish("r", peers, 11)
        settled = [wait_settled(d, "r") for d in decs]
        assert settled == [KVStatus(KVPoll.SUCCESS)] * len(decs), settled
        for d in range(2):
            for layer in range(5):
                assert torch.equal(d_caches[d].flat_k(layer)[dst], ref.flat_k(layer)[src])
                assert torch.equal(d_caches[d].flat_v(layer)[dst], ref.flat_v(layer)[src])
        sent = [s["bytes"] for s in sent_stats(pres, "r")]
        per_layer = 11 * (8 + 4) * 4
        assert sorted(sent) == [3 * per_layer, 3 * per_layer, 4 * per_layer]  # 10 = 4+3+3
    finally:
        for c in pres + decs:
            c.close()


def test_headline_shape_p16_to_d4():
    """DESIGN.md's production shape, tiny caches: 16 prefill ranks, 4 decode ranks, 8 layers;
    each prefill rank sends its quarter of the layers to one decode rank."""
    spec_p = KVCacheSpec(num_layers=8, num_blocks=4, block_size=4, kv_lora_rank=4,
                         qk_rope_head_dim=2)
    spec_d = KVCacheSpec(num_layers=8, num_blocks=2, block_size=8, kv_lora_rank=4,
                         qk_rope_head_dim=2)
    ref = KVCache(spec_p)
    for t in ref.k_caches + ref.v_caches:
        t.copy_(torch.randn(t.shape))
    d_caches = [KVCache(spec_d) for _ in range(4)]
    decs = [DecodeKVConnector(d_caches[d], KVLayout.from_spec(spec_d, "m", 4), "d0", d, CFG)
            for d in range(4)]
    pres = [PrefillKVConnector(ref, KVLayout.from_spec(spec_p, "m", 16), "p0", p, 16, CFG)
            for p in range(16)]
    peers = [KVPeer("d0", d, *decs[d].address) for d in range(4)]
    src, dst = slot_mapping((2, 0, 3), 0, 9, 4), slot_mapping((1, 0), 0, 9, 8)
    try:
        for dec in decs:
            dec.expect("r", 9, prefill_tp=16)
        for pre in pres:
            pre.send_chunk("r", peers, 0, 9, src, dst)
            pre.finish("r", peers, 9)
        settled = [wait_settled(d, "r") for d in decs]
        assert settled == [KVStatus(KVPoll.SUCCESS)] * len(decs), settled
        for d in range(4):
            for layer in range(8):
                assert torch.equal(d_caches[d].flat_k(layer)[dst], ref.flat_k(layer)[src])
                assert torch.equal(d_caches[d].flat_v(layer)[dst], ref.flat_v(layer)[src])
        assert all(s["transfers"] == 1 for s in sent_stats(pres, "r"))  # one pair each
    finally:
        for c in pres + decs:
            c.close()


def test_cp2_prefill_ranks_ship_only_their_pieces_to_d2():
    """Context-parallel prefill (cp 2, tp 1) -> D2, two chunks: each prefill rank's cache is
    right only at the tokens it computed (noise elsewhere), so decode equals the reference
    only if every rank ships exactly its pieces of every chunk."""
    spec_p = KVCacheSpec(num_layers=3, num_blocks=8, block_size=4, kv_lora_rank=8,
                         qk_rope_head_dim=4)
    spec_d = KVCacheSpec(num_layers=3, num_blocks=4, block_size=8, kv_lora_rank=8,
                         qk_rope_head_dim=4)
    n, chunks = 13, ((0, 9), (9, 13))
    src, dst = slot_mapping((6, 1, 4, 0), 0, n, 4), slot_mapping((3, 0), 0, n, 8)
    ref = [torch.randn(n, 8), torch.randn(n, 4)]  # [T, kv_lora_rank], [T, rope]
    plan = build_transfer_plan(1, 2, 3, prefill_cp=2)
    p_caches = [KVCache(spec_p) for _ in range(2)]
    for p, cache in enumerate(p_caches):
        mine = [t for a, b in chunks for lo, hi in plan.token_ranges(p, a, b)
                for t in range(lo, hi)]
        for layer in range(3):
            for flat, want in zip((cache.flat_k(layer), cache.flat_v(layer)), ref):
                flat.copy_(torch.randn(flat.shape))
                flat[src[mine]] = want[mine]
    d_caches = [KVCache(spec_d) for _ in range(2)]
    decs = [DecodeKVConnector(d_caches[d], KVLayout.from_spec(spec_d, "m", 2), "d0", d, CFG)
            for d in range(2)]
    pres = [PrefillKVConnector(p_caches[p], KVLayout.from_spec(spec_p, "m", 1), "p0", p, 1,
                               CFG, cp=2) for p in range(2)]
    peers = [KVPeer("d0", d, *decs[d].address) for d in range(2)]
    try:
        for dec in decs:
            dec.expect("r", n, prefill_tp=1, prefill_cp=2)
        for pre in pres:
            for a, b in chunks:
                pre.send_chunk("r", peers, a, b, src[a:b], dst[a:b])
            pre.finish("r", peers, n)
        settled = [wait_settled(d, "r") for d in decs]
        assert settled == [KVStatus(KVPoll.SUCCESS)] * len(decs), settled
        for d in range(2):
            for layer in range(3):
                assert torch.equal(d_caches[d].flat_k(layer)[dst], ref[0])
                assert torch.equal(d_caches[d].flat_v(layer)[dst], ref[1])
        sent = sorted(s["bytes"] for s in sent_stats(pres, "r"))
        per_token = 2 * 3 * (8 + 4) * 4  # two decode ranks, 3 layers, K + V fp32
        assert sent == [6 * per_token, 7 * per_token]  # chunk 9: 4 + 5, chunk 4: 2 + 2
    finally:
        for c in pres + decs:
            c.close()

"""DeepSeek-V3.2 layouts: the indexer keys (``index_k``) travel as a third buffer with K and V,
byte-exact, in place and through staging; a V3 peer is refused with a clear error."""

import threading

import pytest
import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVLayout, KVPeer, KVPoll, KVStatus,
                         PrefillKVConnector, TransferConfig)
from kv_transfer.errors import LayoutMismatchError

from .cluster import sent_stats, wait_settled

CFG = TransferConfig(connect_timeout_s=30, header_timeout_s=30, payload_timeout_s=30,
                     completion_timeout_s=60)
LAYERS, TOKENS = 3, 21
WIDTHS = (8, 4, 16)  # kv_lora_rank, qk_rope_head_dim, index_head_dim


def _spec(blocks: int, block_size: int, index_head_dim: int = WIDTHS[2]) -> KVCacheSpec:
    return KVCacheSpec(num_layers=LAYERS, num_blocks=blocks, block_size=block_size,
                       kv_lora_rank=WIDTHS[0], qk_rope_head_dim=WIDTHS[1],
                       index_head_dim=index_head_dim)


def _prefill_cache() -> KVCache:
    """Random contents, a different value in every element of every buffer."""
    cache = KVCache(_spec(blocks=12, block_size=4))
    gen = torch.Generator().manual_seed(3)
    for layer in range(LAYERS):
        for buf in cache.flat_buffers(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    return cache


def _transfer(p_tp: int, d_tp: int, dst: torch.Tensor) -> tuple[KVCache, list[KVCache], list]:
    """Send TOKENS tokens (two chunks) from P``p_tp`` to D``d_tp``; returns the prefill cache,
    the decode caches and the prefill connectors' stats."""
    ref, src = _prefill_cache(), slot_mapping((9, 2, 5, 0, 11, 7), 0, TOKENS, 4)
    d_caches = [KVCache(_spec(blocks=8, block_size=8)) for _ in range(d_tp)]
    decs = [DecodeKVConnector(d_caches[d], KVLayout.from_spec(_spec(8, 8), "v32", d_tp), "d0",
                              d, CFG) for d in range(d_tp)]
    pres = [PrefillKVConnector(ref, KVLayout.from_spec(_spec(12, 4), "v32", p_tp), "p0", p,
                               p_tp, CFG) for p in range(p_tp)]  # NOTE: MLA: one shared cache
    peers = [KVPeer("d0", d, *decs[d].address) for d in range(d_tp)]
    try:
        for dec in decs:
            dec.expect("r", TOKENS, prefill_tp=p_tp)
        for pre in pres:
            pre.send_chunk("r", peers, 0, 13, src[:13], dst[:13])
            pre.send_chunk("r", peers, 13, TOKENS, src[13:], dst[13:])
            pre.finish("r", peers, TOKENS)
        assert [wait_settled(d, "r") for d in decs] == [KVStatus(KVPoll.SUCCESS)] * d_tp
        for dec in decs:
            dec.release("r")
        return ref, d_caches, sent_stats(pres, "r")
    finally:
        for c in pres + decs:
            c.close()


def _check(ref: KVCache, d_cache: KVCache, dst: torch.Tensor) -> None:
    src = slot_mapping((9, 2, 5, 0, 11, 7), 0, TOKENS, 4)
    others = torch.ones(8 * 8, dtype=torch.bool)
    others[dst] = False
    for layer in range(LAYERS):
        for name, got, want in zip(("k", "v", "index_k"), d_cache.flat_buffers(layer),
                                   ref.flat_buffers(layer)):
            assert torch.equal(got[dst], want[src]), f"layer {layer} {name} differs"
            assert not got[others].any(), f"layer {layer} {name}: stray writes"


@pytest.mark.parametrize("p_tp,d_tp,table", [(2, 1, (6, 1, 4)), (1, 2, (2, 3, 4))],
                         ids=["P2-D1-scattered", "P1-D2-in-place"])
def test_three_buffers_arrive_byte_exact(p_tp, d_tp, table):
    """P2 -> D1 into scattered decode blocks (staged, then scattered) and P1 -> D2 into
    consecutive ones (received in place): K, V and index_k of every layer land exactly."""
    dst = slot_mapping(table, 0, TOKENS, 8)
    ref, d_caches, stats = _transfer(p_tp, d_tp, dst)
    for d_cache in d_caches:
        _check(ref, d_cache, dst)
    # every decode rank gets every layer of every token, all three buffers, exactly once
    assert sum(s["bytes"] for s in stats) == d_tp * LAYERS * TOKENS * sum(WIDTHS) * 4


def test_v3_and_v32_layouts_are_refused_with_a_clear_error():
    v3 = KVLayout.from_spec(_spec(12, 4, index_head_dim=0), "m", tp=1)
    v32 = KVLayout.from_spec(_spec(12, 4), "m", tp=1)
    assert [b.name for b in v3.buffers] == ["k", "v"]
    assert [b.name for b in v32.buffers] == ["k", "v", "index_k"]
    assert v3.fingerprint() != v32.fingerprint()
    with pytest.raises(LayoutMismatchError) as err:
        v3.check_compatible(v32)
    assert 'buffers: prefill [["k", [8]], ["v", [4]]] vs decode [["k", [8]], ["v", [4]], ' \
        '["index_k", [16]]]' in str(err.value)
    assert "decode caches DeepSeek-V3.2 indexer keys" in str(err.value)


def test_v3_prefill_to_v32_decode_fails_the_request_and_writes_nothing():
    """Over a real pair: the decode side learns the mismatch (abort record), no byte lands."""
    before = [t.name for t in threading.enumerate()]
    v3 = KVCache(_spec(12, 4, index_head_dim=0))
    for t in v3.k_caches + v3.v_caches:
        t.fill_(1.0)
    d_cache = KVCache(_spec(8, 8))
    dec = DecodeKVConnector(d_cache, KVLayout.from_spec(_spec(8, 8), "m", 1), "d0", 0, CFG)
    pre = PrefillKVConnector(v3, KVLayout.from_spec(v3.spec, "m", 1), "p0", 0, 1, CFG)
    peers = [KVPeer("d0", 0, *dec.address)]
    try:
        dec.expect("r", 4, prefill_tp=1)
        pre.send_chunk("r", peers, 0, 4, slot_mapping((1,), 0, 4, 4), slot_mapping((2,), 0, 4, 8))
        pre.finish("r", peers, 4)
        sent = pre.wait("r", 30)
        got = wait_settled(dec, "r")
        assert got.state is KVPoll.FAILED and "indexer keys (index_k" in got.error, got
        assert sent.state is KVPoll.FAILED and "indexer keys (index_k" in sent.error, sent
        assert all(not b.any() for layer in range(LAYERS) for b in d_cache.flat_buffers(layer))
    finally:
        pre.close()
        dec.close()
    assert [t.name for t in threading.enumerate()] == before


def test_a_layout_that_does_not_describe_the_cache_is_refused():
    with pytest.raises(ValueError, match="holds per-token buffers"):
        PrefillKVConnector(KVCache(_spec(12, 4, index_head_dim=0)),
                           KVLayout.from_spec(_spec(12, 4), "m", 1), "p0", 0, 1, CFG)

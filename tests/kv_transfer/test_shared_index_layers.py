"""GLM-5.2 layouts: index_k on the full indexer layers only. A record carries, per layer, the
buffers that layer has: byte-exact, in place and through staging, nothing for a buffer a layer
does not have; a peer whose layers differ is refused."""

import pytest
import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import (DecodeKVConnector, KVChunk, KVLayout, KVPeer, KVPoll, KVStatus,
                         PrefillKVConnector, TransferConfig)
from kv_transfer import packs, wire
from kv_transfer.errors import LayoutMismatchError

from .cluster import sent_stats, wait_settled

CFG = TransferConfig(connect_timeout_s=30, header_timeout_s=30, payload_timeout_s=30,
                     completion_timeout_s=60)
LAYERS, TOKENS = 4, 21
INDEX = (True, False, True, False)  # layers 1 and 3 shared: no index_k
WIDTHS = (8, 4, 16)  # kv_lora_rank, qk_rope_head_dim, index_head_dim


def _spec(blocks: int, block_size: int, index_layers: tuple[bool, ...] = INDEX) -> KVCacheSpec:
    return KVCacheSpec(num_layers=LAYERS, num_blocks=blocks, block_size=block_size,
                       kv_lora_rank=WIDTHS[0], qk_rope_head_dim=WIDTHS[1],
                       index_head_dim=WIDTHS[2], index_layers=index_layers)


def test_cache_allocates_index_k_on_full_layers_only():
    spec = _spec(4, 4)
    cache = KVCache(spec)
    assert [len(cache.layer_buffers(i)) for i in range(LAYERS)] == [3, 2, 3, 2]
    assert [c is None for c in cache.index_caches] == [False, True, False, True]
    assert spec.layer_buffer_names(1) == ("k", "v") and spec.layer_buffer_widths(2) == WIDTHS
    assert spec.bytes_per_token == (LAYERS * 12 + 2 * 16) * 4
    with pytest.raises(ValueError, match="one flag per layer"):
        _spec(4, 4, (True, False))


def test_layout_names_the_index_layers_and_refuses_other_ones():
    shared = KVLayout.from_spec(_spec(12, 4), "glm", tp=1)
    full = KVLayout.from_spec(_spec(12, 4, ()), "glm", tp=1)
    assert shared.buffers[2].layers == (0, 2) and full.buffers[2].layers is None
    assert [b.name for b in shared.layer_buffers(3)] == ["k", "v"]
    assert KVLayout.from_dict(shared.to_dict()) == shared
    assert shared.fingerprint() != full.fingerprint()
    # an all-layers layout keeps the V3.2 fingerprint (no layers field on the wire)
    assert full.to_dict()["buffers"][2] == ["index_k", [16]]
    with pytest.raises(LayoutMismatchError, match=r'\["index_k", \[16\], \[0, 2\]\]'):
        shared.check_compatible(full)
    assert shared.token_layer_bytes((0, 1, 2, 3), None) == (LAYERS * 12 + 2 * 16) * 4


def test_packs_carry_no_bytes_of_a_buffer_a_layer_does_not_have():
    layout = KVLayout.from_spec(_spec(12, 4), "glm", tp=1)
    header = wire.data_header(KVChunk("r", (0, 1, 2, 3), 0, 10, torch.arange(10)), 0, "f")
    (pack,) = packs.packs(layout, header)
    assert pack.nbytes == 10 * (LAYERS * 12 + 2 * 16) * 4
    # a limit of one full layer: one layer a pack, a shared one smaller
    got = packs.packs(layout, header, limit=10 * 28 * 4)
    assert [p.layers for p in got] == [(0,), (1,), (2,), (3,)]
    assert [p.nbytes for p in got] == [1120, 480, 1120, 480]


def _transfer(p_tp: int, d_tp: int, dst: torch.Tensor) -> tuple[KVCache, list[KVCache], list]:
    """Send TOKENS tokens (two chunks) from P``p_tp`` to D``d_tp``."""
    ref, src = KVCache(_spec(12, 4)), slot_mapping((9, 2, 5, 0, 11, 7), 0, TOKENS, 4)
    gen = torch.Generator().manual_seed(3)
    for layer in range(LAYERS):
        for buf in ref.flat_buffers(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen))
    d_caches = [KVCache(_spec(8, 8)) for _ in range(d_tp)]
    decs = [DecodeKVConnector(d_caches[d], KVLayout.from_spec(_spec(8, 8), "glm", d_tp), "d0",
                              d, CFG) for d in range(d_tp)]
    pres = [PrefillKVConnector(ref, KVLayout.from_spec(_spec(12, 4), "glm", p_tp), "p0", p,
                               p_tp, CFG) for p in range(p_tp)]
    peers = [KVPeer("d0", d, *decs[d].address) for d in range(d_tp)]
    try:
        for dec in decs:
            dec.expect("r", TOKENS, prefill_tp=p_tp)
        for pre in pres:
            pre.send_chunk("r", peers, 0, 13, src[:13], dst[:13])
            pre.send_chunk("r", peers, 13, TOKENS, src[13:], dst[13:])
            pre.finish("r", peers, TOKENS)
        assert [wait_settled(d, "r") for d in decs] == [KVStatus(KVPoll.SUCCESS)] * d_tp
        return ref, d_caches, sent_stats(pres, "r")
    finally:
        for c in pres + decs:
            c.close()


@pytest.mark.parametrize("p_tp,d_tp,table", [(2, 1, (6, 1, 4)), (1, 2, (2, 3, 4))],
                         ids=["P2-D1-scattered", "P1-D2-in-place"])
def test_shared_layers_arrive_byte_exact_without_index_k(p_tp, d_tp, table):
    dst = slot_mapping(table, 0, TOKENS, 8)
    src = slot_mapping((9, 2, 5, 0, 11, 7), 0, TOKENS, 4)
    ref, d_caches, stats = _transfer(p_tp, d_tp, dst)
    others = torch.ones(8 * 8, dtype=torch.bool)
    others[dst] = False
    for d_cache in d_caches:
        for layer in range(LAYERS):
            got, want = d_cache.flat_buffers(layer), ref.flat_buffers(layer)
            assert len(got) == len(want) == (3 if INDEX[layer] else 2)
            for name, g, w in zip(("k", "v", "index_k"), got, want):
                assert torch.equal(g[dst], w[src]), f"layer {layer} {name} differs"
                assert not g[others].any(), f"layer {layer} {name}: stray writes"
    # every decode rank gets every layer's own buffers of every token, exactly once
    per_token = LAYERS * (WIDTHS[0] + WIDTHS[1]) + sum(INDEX) * WIDTHS[2]
    sent = [s["bytes"] for s in stats]
    assert sum(sent) == d_tp * TOKENS * per_token * 4, f"bytes sent per prefill rank: {sent}"


def test_a_cache_whose_layers_differ_from_the_layout_is_refused():
    with pytest.raises(ValueError, match="in layer 1"):
        PrefillKVConnector(KVCache(_spec(12, 4)), KVLayout.from_spec(_spec(12, 4, ()), "m", 1),
                           "p0", 0, 1, CFG)

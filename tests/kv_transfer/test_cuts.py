"""Message cuts (zero-copy runs) and transfers through every path: whole record in place,
per-run in place (K) with a staged V, gathered source (block sizes differ), staged only."""

import threading
import time

import pytest
import torch

from engine.block_pool import slot_mapping
from engine.kv_cache import KVCache, KVCacheSpec
from kv_transfer import DecodeKVConnector, KVLayout, KVPeer, PrefillKVConnector, TransferConfig
from kv_transfer import cuts

CFG = TransferConfig(connect_timeout_s=30, header_timeout_s=30, payload_timeout_s=30,
                     completion_timeout_s=60)


def test_runs_and_cuts():
    slots = torch.tensor([8, 9, 10, 11, 4, 5, 6, 7, 20, 21])
    assert cuts.runs(slots) == [(0, 8, 4), (4, 4, 4), (8, 20, 2)]
    assert cuts.runs(torch.arange(5, 12)) == [(0, 5, 7)]
    whole = cuts.cut(torch.arange(5, 12), token_bytes=1)
    assert whole.ranges == ((0, 7),) and whole.dst_starts == (5,) and whole.in_place
    # 10 tokens x 64 KiB in 3 runs: >= MIN_RUN_BYTES per run on average -> one cut per run
    per_run = cuts.cut(slots, token_bytes=64 * 1024)
    assert per_run.ranges == ((0, 4), (4, 4), (8, 2)) and per_run.dst_starts == (8, 4, 20)
    staged = cuts.cut(slots, token_bytes=128)  # short runs: one staged message
    assert staged.ranges == ((0, 10),) and staged.dst_starts == (None,)
    assert not staged.in_place
    # source consecutive inside every cut (merging across cuts is fine)
    assert cuts.src_starts(torch.arange(100, 110), per_run) == [100, 104, 108]
    assert cuts.src_starts(torch.tensor([0, 1, 2, 3, 40, 41, 42, 43, 9, 10]),
                           per_run) == [0, 40, 9]
    assert cuts.src_starts(torch.tensor([0, 1, 7, 8, 4, 5, 6, 7, 9, 10]), per_run) is None


def _transfer(spec_p, spec_d, src_blocks, dst_blocks, tokens, chunk):
    """Send ``tokens`` in chunks P1 -> D1 in one process; returns both caches and slots."""
    p_cache, d_cache = KVCache(spec_p), KVCache(spec_d)
    for t in p_cache.k_caches + p_cache.v_caches:
        t.copy_(torch.randn(t.shape))
    dec = DecodeKVConnector(d_cache, KVLayout.from_spec(spec_d, "m", 1), "d0", 0, CFG)
    pre = PrefillKVConnector(p_cache, KVLayout.from_spec(spec_p, "m", 1), "p0", 0, 1, CFG)
    peers = [KVPeer("d0", 0, *dec.address)]
    src = slot_mapping(src_blocks, 0, tokens, spec_p.block_size)
    dst = slot_mapping(dst_blocks, 0, tokens, spec_d.block_size)
    try:
        dec.expect("r", tokens, prefill_tp=1)
        for a in range(0, tokens, chunk):
            b = min(a + chunk, tokens)
            pre.send_chunk("r", peers, a, b, src[a:b], dst[a:b])
        pre.finish("r", peers, tokens)
        pre.wait_idle("r", 30)
        deadline = time.monotonic() + 30
        while not dec.is_complete("r"):
            assert dec.failure("r") is None, dec.failure("r")
            assert time.monotonic() < deadline, "transfer not complete in time"
            time.sleep(0.005)
        dec.release("r")
        stats = (pre.stats.snapshot(), dec.stats.snapshot())
    finally:
        pre.close()
        dec.close()
    return p_cache, d_cache, src, dst, stats


def _check_bytes(p_cache, d_cache, src, dst):
    written = torch.zeros(d_cache.flat_k(0).shape[0], dtype=torch.bool)
    written[dst] = True
    for layer in range(len(p_cache.k_caches)):
        for flat_p, flat_d in ((p_cache.flat_k, d_cache.flat_k), (p_cache.flat_v, d_cache.flat_v)):
            assert torch.equal(flat_d(layer)[dst], flat_p(layer)[src])
            assert not flat_d(layer)[~written].any(), "bytes written outside the request"


@pytest.mark.parametrize("name,src_blocks,dst_blocks,block_p,block_d,gathers,scatters", [
    # contiguous both sides: every message is a cache view, no copy at all
    ("contiguous", (2, 3, 4, 5), (1, 2, 3, 4), 8, 8, False, False),
    # random tables, same block size: K runs in place, V (short runs) gathered + scattered
    ("random", (7, 2, 5, 0), (3, 6, 1, 4), 8, 8, True, True),
    # decode blocks twice as long: source runs break inside a cut -> gathered
    ("misaligned", (7, 2, 5, 0, 9, 11, 1, 3), (3, 1, 6, 0), 4, 8, True, True),
])
def test_transfer_paths_move_exact_bytes(monkeypatch, name, src_blocks, dst_blocks, block_p,
                                         block_d, gathers, scatters):
    torch.set_num_threads(1)
    # K: 16 x 4 B = 64 B per token, 8-token runs = 512 B; V: 4 x 4 B = 16 B -> 128 B runs
    monkeypatch.setattr(cuts, "MIN_RUN_BYTES", 256)
    spec_p = KVCacheSpec(num_layers=3, num_blocks=12, block_size=block_p, kv_lora_rank=16,
                         qk_rope_head_dim=4)
    spec_d = KVCacheSpec(num_layers=3, num_blocks=8, block_size=block_d, kv_lora_rank=16,
                         qk_rope_head_dim=4)
    p_cache, d_cache, src, dst, (sent, got) = _transfer(spec_p, spec_d, src_blocks,
                                                        dst_blocks, 30, chunk=12)
    _check_bytes(p_cache, d_cache, src, dst)
    assert sent["bytes"] == got["bytes"] == 30 * 3 * (16 + 4) * 4
    assert sent["transfers"] == got["transfers"] == 3
    assert (sent["gather_s"] > 0) == gathers, f"{name}: gather use"
    assert (got["scatter_s"] > 0) == scatters, f"{name}: scatter use"


def test_release_waits_for_an_in_place_receive():
    from tests.kv_transfer.test_tracker import SOURCE, _data, _tracker
    tr = _tracker()
    tr.expect("r", 4, prefill_tp=1)
    header = _data("r", 0, (0, 1, 2), 0, 4)
    req = tr.admit(SOURCE, header, 32)
    assert tr.begin_write(req)  # the receiver holds the permission during the receive
    log = []
    releaser = threading.Thread(target=lambda: (tr.release("r"), log.append("released")))
    releaser.start()
    releaser.join(0.2)
    assert releaser.is_alive(), "release returned while bytes were still being received"
    log.append("received")
    tr.end_write(req, header, True)
    releaser.join(5)
    assert log == ["received", "released"]
    assert not tr.begin_write(req), "a released request must not be written again"

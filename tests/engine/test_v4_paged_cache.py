"""DeepSeek-V4 over paged storage per KV group (engine/v4/paged_cache.py) equals the
contiguous cache bit for bit, with pools small enough that freed window blocks are reused."""

from __future__ import annotations

import torch

from engine.block_pool import BlockPool
from engine.v4.loader import load_v4
from engine.v4.paged_cache import PagedKV
from engine.v4.state_io import export_request


def _paged_kv(config) -> PagedKV:
    pools = {"window": BlockPool(12, 4)}
    for kind in ("compressed_sparse_attention", "heavily_compressed_attention"):
        pools[f"entries/{kind}"], pools[f"state/{kind}"] = BlockPool(8, 4), BlockPool(2, 1)
    return PagedKV(config, pools, torch.float32)


def test_paged_equals_contiguous_and_frees_every_block(tiny_v4_ckpt):
    """Two requests (prefill in 7-token chunks, then decode) interleaved on one storage."""
    model = load_v4(tiny_v4_ckpt)
    kv = _paged_kv(model.config)
    pools = kv.pools
    prompts = [torch.randint(0, 129000, (21,), generator=torch.Generator().manual_seed(s))
               for s in (0, 1)]
    paged = [kv.new_request() for _ in prompts]
    contiguous = [model.new_cache() for _ in prompts]
    tokens = [[] for _ in prompts]
    for step in range(3 + 12):
        for r, prompt in enumerate(prompts):
            ids = prompt[7 * step:7 * step + 7] if step < 3 else torch.tensor(tokens[r][-1:])
            want, got = model(ids, contiguous[r]), model(ids, paged[r])
            assert torch.equal(got, want), (r, step)
            tokens[r].append(int(got[-1].argmax()))
    assert sum(pool.num_free_blocks for pool in pools.values()) < sum(
        pool.num_blocks for pool in pools.values())
    for cache in paged:
        assert cache.blocks.held()["window"] <= 3
        cache.free()
    assert all(pool.num_free_blocks == pool.num_blocks for pool in pools.values())


def test_imported_paged_request_resumes_decode_exactly(tiny_v4_ckpt):
    """Prefill 23 tokens (inside a CSA and an HCA group) on one storage, ship its per-layer
    tensors (state_io) into another storage (what a decode instance would hold): 6 decode
    steps give the sender's logits bit for bit; the receiver took only the kept window's
    blocks (2 of 4 tokens, not the prompt's 6) and frees every block."""
    model = load_v4(tiny_v4_ckpt)
    ids = torch.randint(0, 129000, (29,), generator=torch.Generator().manual_seed(4))
    sender_kv, receiver_kv = _paged_kv(model.config), _paged_kv(model.config)
    sender = sender_kv.new_request()
    model(ids[:23], sender)
    receiver = receiver_kv.import_request(export_request(sender), 23)
    assert receiver.blocks.held()["window"] == 2
    for i in range(23, 29):
        assert torch.equal(model(ids[i:i + 1], receiver), model(ids[i:i + 1], sender))
    for cache, kv in ((sender, sender_kv), (receiver, receiver_kv)):
        cache.free()
        assert all(pool.num_free_blocks == pool.num_blocks for pool in kv.pools.values())

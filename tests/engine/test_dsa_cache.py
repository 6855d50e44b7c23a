"""The V3.2 indexer-key cache: a third per-layer buffer next to K and V."""

import torch

from engine.kv_cache import KVCache, KVCacheSpec


def test_v3_cache_has_two_buffers() -> None:
    spec = KVCacheSpec(num_layers=2, num_blocks=3, block_size=4, kv_lora_rank=8,
                       qk_rope_head_dim=4, dtype=torch.bfloat16)
    cache = KVCache(spec)
    assert spec.buffer_names == ("k", "v") and spec.buffer_widths == (8, 4)
    assert spec.bytes_per_token_per_layer == 12 * 2
    assert cache.index_caches == []
    assert all(t.is_contiguous() for t in cache.layer_buffers(1))  # what device kernels read
    k, v = cache.flat_buffers(1)
    assert k.data_ptr() == cache.k_caches[1].data_ptr() and k.shape == (12, 8)
    assert v.data_ptr() == cache.v_caches[1].data_ptr() and v.shape == (12, 4)


def test_v32_cache_has_index_buffer_viewed_as_slots() -> None:
    spec = KVCacheSpec(num_layers=2, num_blocks=3, block_size=4, kv_lora_rank=8,
                       qk_rope_head_dim=4, dtype=torch.bfloat16, index_head_dim=16)
    cache = KVCache(spec)
    assert spec.buffer_names == ("k", "v", "index_k") and spec.buffer_widths == (8, 4, 16)
    assert spec.bytes_per_token_per_layer == 28 * 2
    assert len(cache.index_caches) == 2 and cache.index_caches[0].shape == (3, 4, 16)
    assert cache.index_caches[0].dtype == torch.bfloat16
    _, _, idx = cache.flat_buffers(1)
    idx[5] = 1.0  # a view: slot 5 is block 1, offset 1
    assert cache.index_caches[1][1, 1].eq(1).all() and cache.index_caches[0].eq(0).all()
    assert cache.index_caches[1].sum() == 16
    assert torch.equal(cache.read(1, torch.tensor([5, 4]))[2][:, 0],
                       torch.tensor([1.0, 0.0], dtype=torch.bfloat16))

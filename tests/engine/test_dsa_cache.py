"""The V3.2 indexer-key cache: a third per-layer buffer next to K and V."""

import pytest
import torch

from engine.kv_cache import KVCache, KVCacheSpec, default_layout, slot_index, slot_rows
from engine.runner import ModelRunner


def test_v3_cache_has_two_buffers() -> None:
    spec = KVCacheSpec(num_layers=2, num_blocks=3, block_size=4, kv_lora_rank=8,
                       qk_rope_head_dim=4, dtype=torch.bfloat16)
    cache = KVCache(spec, layout="layer_major")
    assert spec.buffer_names == ("k", "v") and spec.buffer_widths == (8, 4)
    assert spec.bytes_per_token_per_layer == 12 * 2
    assert cache.index_caches == []
    k, v = cache.row_buffers(1)
    assert k.data_ptr() == cache.k_caches[1].data_ptr() and k.shape == (12, 8)
    assert v.data_ptr() == cache.v_caches[1].data_ptr() and v.shape == (12, 4)


@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_v32_cache_has_index_buffer_viewed_as_slots(layout) -> None:
    spec = KVCacheSpec(num_layers=2, num_blocks=3, block_size=4, kv_lora_rank=8,
                       qk_rope_head_dim=4, dtype=torch.bfloat16, index_head_dim=16)
    cache = KVCache(spec, layout=layout)
    assert spec.buffer_names == ("k", "v", "index_k") and spec.buffer_widths == (8, 4, 16)
    assert spec.bytes_per_token_per_layer == 28 * 2
    assert len(cache.index_caches) == 2 and cache.index_caches[0].shape == (3, 4, 16)
    assert cache.index_caches[0].dtype == torch.bfloat16
    _, _, idx = cache.row_buffers(1)
    idx[cache.row_index(torch.tensor(5))] = 1.0  # a view: slot 5 is block 1, offset 1
    assert cache.index_caches[1][1, 1].eq(1).all() and cache.index_caches[0].eq(0).all()
    assert cache.index_caches[1].sum() == 16
    assert torch.equal(cache.read(1, torch.tensor([5, 4]))[2][:, 0],
                       torch.tensor([1.0, 0.0], dtype=torch.bfloat16))


def test_block_major_puts_one_blocks_layers_together() -> None:
    """block_major: one allocation per buffer ``[blocks, layers, block_size, width]``; each
    layer's cache is a strided view, and slot rows of every layer land where slot_index says
    (the per-layer view and the row view agree for every slot of every layer)."""
    spec = KVCacheSpec(num_layers=3, num_blocks=5, block_size=4, kv_lora_rank=6,
                       qk_rope_head_dim=2)
    cache = KVCache(spec, layout="block_major")
    assert default_layout("cpu") == "block_major" and KVCache(spec).layout == "block_major"
    assert default_layout("cuda") == default_layout("npu") == "layer_major"
    k = cache.backing[0]
    assert k.shape == (5, 3, 4, 6) and k.is_contiguous()
    assert cache.k_caches[2].data_ptr() == k[0, 2].data_ptr()
    assert not cache.k_caches[2].is_contiguous()
    slots = torch.arange(20)
    for layer in range(3):
        cache.k_caches[layer].copy_(torch.arange(5 * 4 * 6, dtype=torch.float32).view(5, 4, 6)
                                    + 1000 * layer)
        rows = slot_rows(cache.k_caches[layer])[slot_index(cache.k_caches[layer], slots)]
        assert torch.equal(rows, cache.k_caches[layer].reshape(20, 6))
    # one block's rows of every layer are one contiguous run of the backing tensor
    assert torch.equal(k[3].flatten(), torch.cat([cache.k_caches[i][3].flatten()
                                                  for i in range(3)]))
    with pytest.raises(ValueError, match="layout 'tiles' is not one of"):
        KVCache(spec, layout="tiles")


def test_runner_refuses_a_bad_kv_layout_before_loading(tmp_path):
    """Checked before the checkpoint is read (a real model loads for minutes first): a
    block_major cache on a device, whose kernels read one contiguous cache per layer, and a
    name that is no layout; on any machine (no CUDA needed)."""
    missing = tmp_path / "no-checkpoint"
    with pytest.raises(ValueError, match="'block_major' is for the cpu path"):
        ModelRunner(missing, num_kv_blocks=4, block_size=4, device="cuda",
                    kv_layout="block_major")
    with pytest.raises(ValueError, match="'nonsense' is not one of"):
        ModelRunner(missing, num_kv_blocks=4, block_size=4, kv_layout="nonsense")

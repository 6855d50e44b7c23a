"""Paged decode attention: the block-table metadata, the tiled absorbed decode against the
padded-copy path and the MHA reference, and the device variants in the kernel registry."""

from __future__ import annotations

import sys

import pytest
import torch

from engine.forward_context import DecodeBatch, build_attention_metadata
from engine.kernels import KERNELS
from engine.mla_ops import (DECODE_TILE_BYTES, DECODE_TILE_TOKENS, attend_selected_absorbed,
                            decode_absorbed, decode_naive, decode_tile_tokens)

H, P, R, V, L, BS = 3, 8, 4, 6, 16, 4  # heads, nope, rope, v, kv_lora_rank, block size


def _case(seq_lens: list[int], seed: int, dtype: torch.dtype = torch.float32):
    """Random caches (8 spare blocks), a DecodeBatch whose sequences own shuffled
    (fragmented) blocks, and random queries / absorbed weights."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in seq_lens) + 8
    k_cache = torch.randn(num_blocks, BS, L, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, BS, R, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in seq_lens:
        blocks, perm = perm[: -(-n // BS)], perm[-(-n // BS):]
        tables.append(tuple(blocks))
    meta = build_attention_metadata([1] * len(seq_lens), [n - 1 for n in seq_lens], tables, BS)
    b = len(seq_lens)
    q_nope = torch.randn(b, H, P, generator=gen).to(dtype)
    q_pe = torch.randn(b, H, R, generator=gen).to(dtype)
    w_uk = torch.randn(H, P, L, generator=gen).to(dtype) * 0.3
    w_uv = torch.randn(H, V, L, generator=gen).to(dtype) * 0.3
    return q_nope, q_pe, k_cache, v_cache, meta.decode, w_uk, w_uv, (P + R) ** -0.5


def test_metadata_carries_block_tables_padded_with_a_valid_block():
    meta = build_attention_metadata([1, 2, 1, 1], [5, 3, 12, 1], [(9, 3), (0, 1), (4, 7, 2, 8),
                                                                     (6, 5, 10)], BS)
    dec = meta.decode
    assert dec.token_index.tolist() == [0, 3, 4]
    assert dec.seq_lens.tolist() == [6, 13, 2] and dec.seq_lens.dtype == torch.int32
    # widest row needs 4 blocks; shorter rows repeat their own last block; blocks past
    # seq_len (10 of the last table) are not listed
    assert dec.block_table.tolist() == [[9, 3, 3, 3], [4, 7, 2, 8], [6, 6, 6, 6]]
    assert meta.slot_mapping.tolist() == [3 * BS + 1, 0 * BS + 3, 1 * BS, 8 * BS, 6 * BS + 1]
    sel = dec.padded_slots(BS)
    assert sel.slots.shape == (3, 16)
    assert sel.slots[0, :6].tolist() == [36, 37, 38, 39, 12, 13]
    assert sel.valid.sum(1).tolist() == [6, 13, 2]
    assert build_attention_metadata([1], [0], [(2,)], BS).decode is None  # a 1-token prompt


@pytest.mark.parametrize("tile_tokens", [None, 1, BS, 2 * BS, 3 * BS + 1, 16 * BS])
@pytest.mark.parametrize("seq_lens", [[2], [5, 17, 2, 9], [33, 2, 12]])
def test_tiled_decode_equals_padded_copy_and_mha_reference(seq_lens, tile_tokens):
    args = _case(seq_lens, seed=len(seq_lens) * 10 + (tile_tokens or 0))
    batch = args[4]
    tiled = decode_absorbed(*args, tile_tokens=tile_tokens)
    padded = attend_selected_absorbed(*args[:4], batch.padded_slots(BS), *args[5:])
    naive = decode_naive(*args)
    assert tiled.shape == (len(seq_lens), H, V)
    torch.testing.assert_close(tiled, padded)
    torch.testing.assert_close(tiled, naive)


def test_decode_tile_grows_to_the_byte_budget():
    """A tile holds DECODE_TILE_BYTES (gathers + fp32 scores and probabilities), never fewer
    than DECODE_TILE_TOKENS tokens: DeepSeek-V3 tp-8 dims at batch 32 keep 256, the tiny
    model's batch of 8 reads a 300-token context in one tile."""
    assert decode_tile_tokens(32, 16, 512 + 64, 4) == DECODE_TILE_TOKENS
    per_token = 8 * (48 * 4 + 2 * 4 * 4)
    assert decode_tile_tokens(8, 4, 48, 4) == DECODE_TILE_BYTES // per_token > 300
    assert decode_tile_tokens(1, 128, 576, 2) == DECODE_TILE_BYTES // (576 * 2 + 2 * 128 * 4)


def test_tiled_decode_reads_only_each_sequences_positions():
    """Stale entries past a sequence's length in its last block (huge c_kv, inf k_pe) and
    the padding columns never leak into its output."""
    q_nope, q_pe, k_cache, v_cache, batch, w_uk, w_uv, scale = _case([6, 30], seed=3)
    ref = decode_absorbed(q_nope, q_pe, k_cache, v_cache, batch, w_uk, w_uv, scale)
    last = batch.block_table[0, 1]  # holds positions 4, 5 of sequence 0; 6, 7 are unused
    k_cache[last, 2:], v_cache[last, 2:] = 1e4, float("inf")
    out = decode_absorbed(q_nope, q_pe, k_cache, v_cache, batch, w_uk, w_uv, scale,
                          tile_tokens=2 * BS)
    torch.testing.assert_close(out, ref)


def test_tiled_decode_in_bfloat16_stays_close_to_float32():
    args32 = _case([40, 7], seed=5)
    args16 = _case([40, 7], seed=5, dtype=torch.bfloat16)
    out16 = decode_absorbed(*args16, tile_tokens=2 * BS)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), decode_absorbed(*args32), atol=0.05, rtol=0.05)


def test_registry_lists_device_decode_variants_and_refuses_them_on_cpu():
    assert KERNELS.variants("mla_decode") == ["absorbed", "flashinfer", "naive", "npu"]
    for variant, device in (("flashinfer", "cuda"), ("npu", "npu")):
        with pytest.raises(KeyError, match=f"no 'cpu' implementation; available on \\['{device}'"):
            KERNELS.resolve("cpu", {"mla_decode": variant})
    assert KERNELS.resolve("cpu").sparse_decode is attend_selected_absorbed
    assert "flashinfer" not in sys.modules and "torch_npu" not in sys.modules


def test_decode_batch_is_tensor_shaped():
    """Only tensors travel in the decode metadata (graph capture keys on shapes)."""
    batch = _case([9, 3], seed=1)[4]
    assert isinstance(batch, DecodeBatch)
    assert all(isinstance(getattr(batch, f), torch.Tensor)
               for f in ("token_index", "block_table", "seq_lens"))


def _peak_bytes(fn) -> int:
    """Peak running total of the bytes ``fn`` allocates (profiler memory events, in order)."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def test_tiled_decode_holds_one_tile_not_the_padded_copy():
    args = _case([250, 251, 249, 252], seed=9)  # 64 blocks of 4 per sequence
    padded_bytes = 4 * 64 * BS * (L + R) * 4
    peak = _peak_bytes(lambda: decode_absorbed(*args, tile_tokens=2 * BS))
    assert peak < padded_bytes / 4
    padded = args[4].padded_slots(BS)  # the probe sees a padded copy where there is one
    assert _peak_bytes(lambda: attend_selected_absorbed(*args[:4], padded, *args[5:])) \
        > padded_bytes

"""Chunked-prefill attention pieces against a direct softmax over the whole key sequence:
``attend_with_lse`` (output and log-sum-exp) and the LSE merge of cached-prefix tiles with the
chunk's causal part."""

from __future__ import annotations

import pytest
import torch

from engine.mla_ops import attend_causal, attend_with_lse, merge_attention

H, D, V = 4, 6, 5  # heads, qk head dim, v head dim
SCALE = D ** -0.5


def _qkv(t: int, s: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[T, H, D]``, k ``[S, H, D]``, v ``[S, H, V]``; the first third of the keys is
    scaled up so their softmax weights dwarf the rest (a lopsided merge)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(t, H, D, generator=gen), torch.randn(s, H, D, generator=gen)
    k[: s // 3] *= 4
    return q, k, torch.randn(s, H, V, generator=gen)


def _direct(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all S keys, query i at absolute position ``S - T + i`` seeing keys up to
    it: ``(o [T, H, V], lse [H, T])``."""
    t, s = q.shape[0], k.shape[0]
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * SCALE  # [H, T, S]
    seen = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]  # [T, S]
    scores = scores.masked_fill(~seen, float("-inf"))
    o = torch.einsum("hts,shv->thv", scores.softmax(-1), v.double())
    return o.float(), scores.logsumexp(-1).float()


@pytest.mark.parametrize("t,s", [(1, 1), (4, 4), (3, 11), (7, 20)])
def test_attend_with_lse_equals_direct_softmax(t, s):
    q, k, v = _qkv(t, s, seed=t * 100 + s)
    o, lse = attend_with_lse(q, k, v, SCALE, causal=True)
    o_ref, lse_ref = _direct(q, k, v)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)
    assert lse.shape == (H, t)


@pytest.mark.parametrize("v_dim", [V, D + 3])  # narrower / wider than the qk head dim
def test_causal_attention_with_any_v_head_dim(v_dim):
    q, k, _ = _qkv(9, 9, seed=v_dim)
    v = torch.randn(9, H, v_dim, generator=torch.Generator().manual_seed(1))
    o_ref, lse_ref = _direct(q, k, v)
    torch.testing.assert_close(attend_causal(q, k, v, SCALE), o_ref)
    o, lse = attend_with_lse(q, k, v, SCALE, causal=True)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


@pytest.mark.parametrize("t", [1, 4, 6])  # 4 == H: a [T, H] / [H, T] mix-up broadcasts here
@pytest.mark.parametrize("tiles", [(13,), (5, 1, 7), (1, 12)])
def test_merged_prefix_tiles_and_chunk_equal_direct_softmax(t, tiles):
    """As MLAttention._prefill does it: causal over the chunk, then one merge per prefix tile."""
    prefix = sum(tiles)
    q, k, v = _qkv(t, prefix + t, seed=7 * t + len(tiles))
    o, lse = attend_with_lse(q, k[prefix:], v[prefix:], SCALE, causal=True)
    start = 0
    for n in tiles:
        part = slice(start, start + n)
        o_tile, lse_tile = attend_with_lse(q, k[part], v[part], SCALE, causal=False)
        o, lse = merge_attention(o, lse, o_tile, lse_tile)
        start += n
    o_ref, lse_ref = _direct(q, k, v)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


def test_merge_is_symmetric_and_keeps_the_dtype():
    q, k, v = _qkv(3, 9, seed=1)
    a = attend_with_lse(q, k[:4], v[:4], SCALE, causal=False)
    b = attend_with_lse(q, k[4:], v[4:], SCALE, causal=False)
    o_ab, lse_ab = merge_attention(*a, *b)
    o_ba, lse_ba = merge_attention(*b, *a)
    torch.testing.assert_close(o_ab, o_ba)
    torch.testing.assert_close(lse_ab, lse_ba)
    o16, _ = merge_attention(a[0].half(), a[1], b[0].half(), b[1])
    assert o16.dtype == torch.float16

"""KVLayout: fingerprint stability, what must match, mismatch messages."""

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer.errors import LayoutMismatchError
from kv_transfer.layout import KVLayout


def _spec(**kw):
    base = dict(num_layers=4, num_blocks=8, block_size=4, kv_lora_rank=16, qk_rope_head_dim=8)
    return KVCacheSpec(**{**base, **kw})


def test_fingerprint_ignores_tp_and_block_size():
    a = KVLayout.from_spec(_spec(), "m", tp=16)
    b = KVLayout.from_spec(_spec(block_size=128, num_blocks=3), "m", tp=4)
    assert a.fingerprint() == b.fingerprint()
    a.check_compatible(b)
    assert KVLayout.from_dict(a.to_dict()) == a
    assert len(a.fingerprint()) == 16
    assert a.fingerprint() == "%s" % KVLayout.from_spec(_spec(), "m", tp=16).fingerprint()


def test_mismatch_names_each_field_with_both_values():
    a = KVLayout.from_spec(_spec(), "m", tp=2)
    b = KVLayout.from_spec(_spec(dtype=torch.bfloat16, num_layers=5, kv_lora_rank=32), "m2", 1)
    assert a.fingerprint() != b.fingerprint()
    with pytest.raises(LayoutMismatchError) as err:
        a.check_compatible(b)
    msg = str(err.value)
    assert "dtype: prefill float32 vs decode bfloat16" in msg
    assert "num_layers: prefill 4 vs decode 5" in msg
    assert "model: prefill m vs decode m2" in msg
    assert 'buffers: prefill [["k", [16]], ["v", [8]]] vs decode [["k", [32]], ["v", [8]]]' in msg


def test_rope_layout_is_part_of_the_fingerprint():
    a = KVLayout.from_spec(_spec(), "m", tp=1)
    b = KVLayout.from_spec(_spec(rope_layout="deinterleaved"), "m", tp=1)
    with pytest.raises(LayoutMismatchError, match="rope_layout: prefill interleaved vs decode"):
        a.check_compatible(b)


def test_gqa_layout_heads():
    lay = KVLayout.gqa("g", 2, 16, num_kv_heads=8, head_dim=4, dtype=torch.float16, tp=4)
    assert lay.heads_of(1) == range(2, 4)
    assert lay.token_dims(lay.buffers[0], range(2, 4)) == (2, 4)
    assert KVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ValueError, match="cannot be split"):
        KVLayout.gqa("g", 2, 16, num_kv_heads=8, head_dim=4, dtype=torch.float16, tp=3)

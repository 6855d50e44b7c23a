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


def test_fingerprint_is_the_same_in_every_process():
    """Prefill and decode ranks compute it in separate processes (and may run different
    builds): a committed value, so a per-process hash or any change of the hashed fields or
    their encoding fails here. Change the literals only together with a note that old and new
    instances cannot exchange KV."""
    assert KVLayout.from_spec(_spec(), "m", tp=16).fingerprint() == "c8ea0b60dddd44c2"
    gqa = KVLayout.gqa("g", 2, 16, num_kv_heads=8, head_dim=4, dtype=torch.float16, tp=4)
    assert gqa.fingerprint() == "f8f2cbdd26e33670"


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

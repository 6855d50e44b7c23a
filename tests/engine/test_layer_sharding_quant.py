"""Layer sharding of a linear a W8A8 checkpoint stores quantized is refused with the fix
named, before anything is allocated (it failed with "`weight` is not an nn.Parameter")."""

from __future__ import annotations

import pytest

from engine.parallel import CPGroup
from engine.quant.writer import quantize_checkpoint
from engine.runner import ModelRunner


def test_sharding_a_quantized_linear_names_the_fix(tiny_ckpt, tmp_path):
    ckpt = quantize_checkpoint(tiny_ckpt, tmp_path / "w8a8", "w8a8")
    with pytest.raises(ValueError, match="layer_sharding: q_b_proj is quantized in this "
                                         "checkpoint .*drop it from layer_sharding"):
        ModelRunner(ckpt, num_kv_blocks=4, block_size=16, cp=CPGroup(rank=1, size=2),
                    layer_sharding=("q_b_proj",))

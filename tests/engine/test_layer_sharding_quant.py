"""Layer sharding over quantized checkpoints: a linear kept quantized (W8A8) is refused with
the fix named, before anything is allocated; FP8 linears dequantized at load shard like
float ones."""

from __future__ import annotations

import pytest
import torch

from engine.parallel import CPGroup
from engine.quant.writer import quantize_checkpoint
from engine.runner import ModelRunner


def test_sharding_a_quantized_linear_names_the_fix(tiny_ckpt, tmp_path):
    ckpt = quantize_checkpoint(tiny_ckpt, tmp_path / "w8a8", "w8a8")
    with pytest.raises(ValueError, match="layer_sharding: q_b_proj is quantized in this "
                                         "checkpoint .*drop it from layer_sharding"):
        ModelRunner(ckpt, num_kv_blocks=4, block_size=16, cp=CPGroup(rank=1, size=2),
                    layer_sharding=("q_b_proj",))


def test_fp8_dequantized_linears_shard_and_the_owned_layer_loads(tiny_ckpt, tmp_path):
    """FP8 dequantized at load gives float linears: CP rank 1 of 2 stores layer 1 only
    (it failed reading layer 0's weight into the empty placeholder)."""
    ckpt = quantize_checkpoint(tiny_ckpt, tmp_path / "fp8", "fp8-block")
    whole = ModelRunner(ckpt, num_kv_blocks=4, block_size=16).model.model.layers
    sharded = ModelRunner(ckpt, num_kv_blocks=4, block_size=16, cp=CPGroup(rank=1, size=2),
                          layer_sharding=("q_b_proj", "o_proj")).model.model.layers
    for name in ("q_b_proj", "o_proj"):
        assert getattr(sharded[0].self_attn, name).weight.numel() == 0
        assert torch.equal(getattr(sharded[1].self_attn, name).weight,
                           getattr(whole[1].self_attn, name).weight)


def test_dry_run_refuses_sharding_a_quantized_linear(tiny_ckpt, tmp_path, capsys):
    """`orch up --dry-run` reads the checkpoint and refuses (exit 2) what every CP rank would
    refuse at load; FP8 dequantized at load passes."""
    from orchestrator.cli import main

    for fmt, code in (("w8a8", 2), ("fp8-block", 0)):
        ckpt = quantize_checkpoint(tiny_ckpt, tmp_path / fmt, fmt)
        path = tmp_path / f"{fmt}.yaml"
        path.write_text(f"model: {{path: {ckpt}, max_model_len: 256}}\ncluster: {{device: cpu}}\n"
                        "prefill: {cp: 2, layer_sharding: [q_b_proj, o_proj]}\n")
        assert main(["up", "--dry-run", str(path)]) == code, fmt
    err = capsys.readouterr().err
    assert "prefill.layer_sharding: ['q_b_proj', 'o_proj'] are stored quantized (w8a8" in err

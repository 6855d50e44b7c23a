"""Stored weight bytes under FP8 block / W8A8 (what the memory plan counts)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import KERNELS
from engine.loader import load_weights
from engine.model import build_model
from engine.model_config import load_model_config
from engine.parallel import TPGroup
from engine.quant.formats import FP8_BLOCK, W8A8_INT8, QuantScheme
from engine.quant.load import quant_plan
from engine.quant.memory import bytes_per_param, stored_weight_bytes
from engine.quant.writer import quantize_checkpoint

FP8 = QuantScheme(FP8_BLOCK, (128, 128))
W8A8 = QuantScheme(W8A8_INT8)


def test_hand_computed_bytes_of_a_deepseek_v3_expert_weight():
    name, shape = "model.layers.5.mlp.experts.17.down_proj.weight", (7168, 2048)
    assert stored_weight_bytes(name, shape, None, 2) == 7168 * 2048 * 2
    assert stored_weight_bytes(name, shape, FP8, 2, "fp8") == 7168 * 2048 + 4 * 56 * 16
    assert stored_weight_bytes(name, shape, FP8, 2, "dequantize") == 7168 * 2048 * 2
    assert stored_weight_bytes(name, shape, W8A8, 2) == 7168 * 2048 + 4 * 7168
    kv_b = "model.layers.5.self_attn.kv_b_proj.weight"  # dequantized at load
    assert stored_weight_bytes(kv_b, (32768, 512), W8A8, 2) == 32768 * 512 * 2
    assert stored_weight_bytes("lm_head.weight", (129280, 7168), FP8, 2, "fp8") == \
        129280 * 7168 * 2
    assert bytes_per_param(W8A8, 2) == pytest.approx(1 + 4 / 2048)


@pytest.mark.parametrize("scheme, fp8_storage", [("w8a8", "dequantize"), ("fp8-block", "fp8"),
                                                 ("fp8-block", "dequantize")])
def test_counted_bytes_equal_what_the_loaded_model_holds(tiny_ckpt, tmp_path, scheme,
                                                         fp8_storage):
    ckpt = quantize_checkpoint(tiny_ckpt, tmp_path / scheme, scheme)
    config = load_model_config(ckpt)
    plan = quant_plan(ckpt, config.quantization, fp8_storage)
    model = build_model(config, TPGroup(), KERNELS.resolve("cpu"), torch.float32,
                        torch.device("cpu"), plan)
    load_weights(model, ckpt, TPGroup())
    held = sum(t.numel() * t.element_size()
               for t in [*model.parameters(), *model.buffers()]) \
        - sum(b.numel() * b.element_size() for b in model.rotary.buffers())
    float_model = build_model(config, TPGroup(), KERNELS.resolve("cpu"), torch.float32,
                              torch.device("meta"))
    counted = sum(stored_weight_bytes(n, tuple(p.shape), config.quantization, 4, fp8_storage)
                  for n, p in float_model.named_parameters())
    assert held == counted

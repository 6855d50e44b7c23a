"""quantization_config parsing: the two supported formats, and errors naming them."""

from __future__ import annotations

import json

import pytest

from engine.model_config import ModelConfig
from engine.quant.formats import (FP8_BLOCK, W8A8_INT8, UnsupportedQuantizationError,
                                  parse_quantization_config)
from engine.quant.writer import quantization_config
from orchestrator.tiny_model import tiny_config_dict

DEEPSEEK_V3_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                   "weight_block_size": [128, 128]}  # DeepSeek-V3's config.json, verbatim


def test_deepseek_fp8_config_parses_into_model_config():
    raw = {**tiny_config_dict(), "quantization_config": DEEPSEEK_V3_FP8}
    scheme = ModelConfig.from_dict(raw).quantization
    assert (scheme.method, scheme.block_size, scheme.scale_suffix) == \
        (FP8_BLOCK, (128, 128), "weight_scale_inv")
    assert ModelConfig.from_dict(tiny_config_dict()).quantization is None


def test_compressed_tensors_w8a8_parses():
    scheme = parse_quantization_config(quantization_config("w8a8"))
    assert (scheme.method, scheme.block_size, scheme.scale_suffix) == \
        (W8A8_INT8, None, "weight_scale")


@pytest.mark.parametrize("raw, field", [
    ({"quant_method": "awq", "bits": 4}, "quant_method"),
    ({"quant_method": "gptq"}, "quant_method"),
    ({**DEEPSEEK_V3_FP8, "fmt": "e5m2"}, "fmt"),
    ({**DEEPSEEK_V3_FP8, "weight_block_size": None}, "weight_block_size"),
    ({**quantization_config("w8a8"), "format": "float-quantized"}, "format"),
    # malformed JSON shapes: the same error naming the field, never an AttributeError
    ({**DEEPSEEK_V3_FP8, "weight_block_size": ["a", 128]}, "weight_block_size"),
    ({**DEEPSEEK_V3_FP8, "weight_block_size": [1.5, 128]}, "weight_block_size"),
    ({**quantization_config("w8a8"), "config_groups": [1, 2]}, "config_groups"),
    ({**quantization_config("w8a8"), "config_groups": {"g": "x"}}, "config_groups.g"),
    ({**quantization_config("w8a8"), "config_groups": {"g": {"targets": "Linear"}}},
     "config_groups.g.targets"),
    ({**quantization_config("w8a8"), "config_groups": {"g": {"targets": ["Linear"],
                                                             "weights": 8}}},
     "config_groups.g.weights"),
])
def test_other_methods_are_refused_naming_what_is_supported(raw, field):
    with pytest.raises(UnsupportedQuantizationError) as err:
        parse_quantization_config(raw)
    assert f"quantization_config.{field}" in str(err.value)
    assert "fp8" in str(err.value) and "compressed-tensors" in str(err.value)


def test_a_quantization_config_that_is_no_object_is_refused():
    with pytest.raises(UnsupportedQuantizationError, match=r"config.json quantization_config "
                                                           r"is 'fp8' \(an object is expected\)"):
        parse_quantization_config("fp8")


def test_w8a8_with_per_tensor_weights_is_refused():
    raw = quantization_config("w8a8")
    raw["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    with pytest.raises(UnsupportedQuantizationError, match=r"weights\.strategy.*'channel'"):
        parse_quantization_config(raw)


# written by llm-compressor 0.14.0.1 (compressed-tensors 0.19.0), QuantizationModifier(
# targets="Linear", scheme="W8A8", ignore=["lm_head"]) on the tiny model, data-free oneshot
LLMCOMPRESSOR_W8A8 = json.loads("""{"config_groups": {"group_0": {"format": "int-quantized",
"input_activations": {"actorder": null, "block_structure": null, "dynamic": true,
"group_size": null, "num_bits": 8, "observer": null, "observer_kwargs": {},
"scale_dtype": null, "strategy": "token", "symmetric": true, "type": "int", "zp_dtype": null},
"output_activations": null, "targets": ["Linear"], "weights": {"actorder": null,
"block_structure": null, "dynamic": false, "group_size": null, "num_bits": 8,
"observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": null,
"strategy": "channel", "symmetric": true, "type": "int", "zp_dtype": null}}},
"format": "int-quantized", "global_compression_ratio": null, "ignore":
["model.layers.1.mlp.gate", "model.layers.2.mlp.gate", "lm_head"], "kv_cache_scheme": null,
"quant_method": "compressed-tensors", "quantization_status": "compressed",
"sparsity_config": {}, "transform_config": {}, "version": "0.19.0"}""")


def test_llmcompressor_w8a8_config_parses():
    assert parse_quantization_config(LLMCOMPRESSOR_W8A8).method == W8A8_INT8


def test_model_fp8_storage_reaches_every_instance_and_is_checked():
    from orchestrator.config.schema import OrchConfig

    sections = {"model": {"fp8_storage": "fp8"}, "cluster": {"device": "cpu"}}
    assert {i.fp8_storage for i in OrchConfig.model_validate(sections).instances()} == {"fp8"}
    assert {i.fp8_storage for i in OrchConfig.model_validate(
        {"cluster": {"device": "cpu"}}).instances()} == {"dequantize"}
    with pytest.raises(ValueError, match="fp8_storage"):
        OrchConfig.model_validate({"model": {"fp8_storage": "fp16"}})

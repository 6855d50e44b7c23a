"""engine/v4/loader.py refuses a quantized DeepSeek-V4 checkpoint it cannot read clearly, whether
its config.json is wrong (per-tensor FP8) or only its tensors say it is quantized (FP8 / int8
weights under an unquantized config.json): never a torch promotion error, never FP8 values cast
to float as if they were the weights. FP8 block checkpoints load: tests/engine/test_v4_fp8.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config import CheckpointError
from engine.v4.loader import load_v4


def _copy(src, dst, weights=None, config=None):
    shutil.copytree(src, dst)
    if weights is not None:
        path = dst / "model.safetensors"
        tensors = load_file(str(path))
        weights(tensors)
        save_file(tensors, str(path))
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def _fp8_experts(count: int):
    def change(tensors):
        names = sorted(k for k in tensors if ".ffn.experts." in k and k.endswith(".weight"))
        for name in names[:count]:
            tensors[name] = tensors[name].to(torch.float8_e4m3fn)
            tensors[name.removesuffix(".weight") + ".scale"] = torch.ones(1)
    return change


def _int8_attention(tensors):
    name = next(k for k in tensors if k.endswith("attn.wq_a.weight"))
    tensors[name] = tensors[name].to(torch.int8)


@pytest.mark.parametrize("weights", [_fp8_experts(1), _fp8_experts(10 ** 6), _int8_attention],
                         ids=["one fp8 expert", "every expert fp8", "int8 attention"])
def test_quantized_tensors_under_an_unquantized_config_are_refused(tiny_v4_ckpt, tmp_path,
                                                                   weights):
    ckpt = _copy(tiny_v4_ckpt, tmp_path / "v4", weights=weights)
    # NOTE: a scale without quantization_config, or a 1-byte / integer weight without a scale
    with pytest.raises(CheckpointError, match=r"config\.json has no quantization_config|"
                                              r"torch\.int8 with no scale tensor"):
        load_v4(ckpt)


def test_an_fp8_quantization_config_without_blocks_is_refused(tiny_v4_ckpt, tmp_path):
    # NOTE: FP8 block checkpoints load (tests/engine/test_v4_fp8.py); per-tensor FP8 does not
    ckpt = _copy(tiny_v4_ckpt, tmp_path / "v4",
                 config=lambda raw: raw.update(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(CheckpointError, match="weight_block_size is None.*convert"):
        load_v4(ckpt)

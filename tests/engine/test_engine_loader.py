"""Checkpoint loading: both config/weight flavours, and errors that name the culprit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config import CheckpointError
from engine.model_config import UnsupportedModelError
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint

STEP = [SeqStep("a", tuple(range(200, 233)), 0, (0, 1, 2))]


def _logits(ckpt) -> torch.Tensor:
    return ModelRunner(ckpt, num_kv_blocks=4, block_size=16).execute(STEP)


@pytest.fixture(scope="module")
def ref_logits(tiny_ckpt):
    return _logits(tiny_ckpt)


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory):
    """Same weights as ``tiny_ckpt``, written 5.x style: fused experts + rope_parameters."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v5"), seed=0, fused_experts=True,
                                 rope_style="5.x")


def _copy_with(src, dst, edit_state=None, edit_config=None):
    shutil.copytree(src, dst)
    if edit_state:
        state = load_file(dst / "model.safetensors")
        edit_state(state)
        save_file(state, str(dst / "model.safetensors"))
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fused_experts_and_rope_parameters_flavour_gives_same_logits(fused_ckpt, ref_logits):
    v5 = fused_ckpt
    names = load_file(v5 / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert "rope_parameters" in json.loads((v5 / "config.json").read_text())
    torch.testing.assert_close(_logits(v5), ref_logits, rtol=0, atol=0)


def test_checkpoint_saved_by_transformers5_loads(tiny_ckpt, tmp_path, ref_logits):
    """transformers 5.23 save_pretrained writes ``rope_parameters`` (no rope_scaling)."""
    from transformers import DeepseekV3ForCausalLM

    DeepseekV3ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).save_pretrained(
        tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == "yarn" and not saved.get("rope_scaling")
    torch.testing.assert_close(_logits(tmp_path / "hf"), ref_logits, rtol=0, atol=0)


def test_extra_tensors_such_as_mtp_layer_are_skipped(tiny_ckpt, tmp_path, ref_logits):
    def add_mtp(state):
        state["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
        state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)

    ckpt = _copy_with(tiny_ckpt, tmp_path / "mtp", edit_state=add_mtp)
    torch.testing.assert_close(_logits(ckpt), ref_logits, rtol=0, atol=0)


def test_missing_tensor_is_named_with_its_shape(tiny_ckpt, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    ckpt = _copy_with(tiny_ckpt, tmp_path / "miss", edit_state=lambda s: s.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing.*{name} \(32, 64\)"):
        _logits(ckpt)


def test_wrong_shape_is_named_with_expected_shape(tiny_ckpt, tmp_path):
    name = "model.layers.0.self_attn.kv_b_proj.weight"

    def shrink(state):
        state[name] = state[name][:-1]

    ckpt = _copy_with(tiny_ckpt, tmp_path / "shape", edit_state=shrink)
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(255, 32\).*\(256, 32\)"):
        _logits(ckpt)


def test_unsupported_architecture_is_named(tiny_ckpt, tmp_path):
    def to_llama(cfg):
        cfg["architectures"] = ["LlamaForCausalLM"]

    ckpt = _copy_with(tiny_ckpt, tmp_path / "arch", edit_config=to_llama)
    with pytest.raises(UnsupportedModelError, match="architectures.*LlamaForCausalLM.*"
                                                    "DeepseekV3ForCausalLM"):
        _logits(ckpt)


def test_tiny_checkpoint_is_deterministic(tiny_ckpt, tmp_path, capsys):
    from orchestrator.tiny_model import init_tiny_main

    again = init_tiny_main(tmp_path / "again", seed=0)
    assert str(again) in capsys.readouterr().out
    ref = write_tiny_checkpoint(tmp_path / "ref", seed=0, mtp_layers=1)  # init-tiny writes MTP
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (ref / name).read_bytes(), name
    # NOTE: the MTP weights come from their own generator: the main weights are unchanged
    plain = load_file(tiny_ckpt / "model.safetensors")
    with_mtp = load_file(ref / "model.safetensors")
    assert plain.keys() < with_mtp.keys() and all(torch.equal(v, with_mtp[k])
                                                  for k, v in plain.items())
    other = load_file(write_tiny_checkpoint(tmp_path / "s1", seed=1) / "model.safetensors")
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert not torch.equal(other[bias], load_file(again / "model.safetensors")[bias])
    assert other[bias].abs().min() > 0


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_shards_read_from_both_flavours_agree(tiny_ckpt, fused_ckpt, rank):
    """Loading as rank r of 2 (no process group needed) slices rows/columns the same way
    from per-expert and fused checkpoints, and takes the r-th half of the full tensor."""
    from engine.kernels import KERNELS
    from engine.loader import load_weights
    from engine.model import build_model
    from engine.model_config import load_model_config
    from engine.parallel import TPGroup

    tp, cfg = TPGroup(rank=rank, size=2), load_model_config(tiny_ckpt)
    models = []
    for ckpt in (tiny_ckpt, fused_ckpt):
        model = build_model(cfg, tp, KERNELS.resolve("cpu"), torch.float32, torch.device("cpu"))
        load_weights(model, ckpt, tp)
        models.append(dict(model.named_parameters()))
    assert models[0].keys() == models[1].keys()
    for name in models[0]:
        torch.testing.assert_close(models[0][name], models[1][name], rtol=0, atol=0)
    full = load_file(tiny_ckpt / "model.safetensors")
    rows = "model.layers.2.mlp.experts.3.up_proj.weight"  # [32, 64] -> 16 rows per rank
    cols = "model.layers.0.self_attn.o_proj.weight"  # [64, 128] -> 64 columns per rank
    assert torch.equal(models[0][rows], full[rows][16 * rank:16 * (rank + 1)])
    assert torch.equal(models[0][cols], full[cols][:, 64 * rank:64 * (rank + 1)])
    assert torch.equal(models[0]["model.layers.0.self_attn.q_a_proj.weight"],
                       full["model.layers.0.self_attn.q_a_proj.weight"])


def test_tiny_checkpoint_tokenizer_feeds_the_model(tiny_ckpt):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json")).encode("Hello, DeepSeek!").ids
    assert 0 < len(ids) < 10 and max(ids) < 129280
    logits = ModelRunner(tiny_ckpt, num_kv_blocks=1, block_size=16).execute(
        [SeqStep("t", tuple(ids), 0, (0,))])
    assert logits.shape == (1, 129280) and torch.isfinite(logits).all()

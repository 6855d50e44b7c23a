"""DeepSeek-V4 FP8 block checkpoints (engine/v4/loader.py): the tiny checkpoint of ``orch model
init-tiny --arch deepseek_v4`` with the linears DeepSeek-V4-Flash's release stores FP8
(attention ``wq_a`` / ``wq_b`` / ``wkv`` / ``wo_a`` / ``wo_b``, the indexer's ``wq_b``, shared
and routed experts; not the compressors' ``wkv`` / ``wgate``, the indexer's ``weights_proj``,
the router, embedding, head, norms, mHC) quantized to e4m3 blocks, scales half as the release
writes them (``<module>.scale``, ue8m0 powers of two, float8_e8m0fnu) and half as V3 / HF
(``<module>.weight_scale_inv`` float32). Reference: transformers' ``DeepseekV4ForCausalLM``
(fp32, eager) on the same weights dequantized, written as a float checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config import CheckpointError
from engine.quant.fp8_block import FP8_MAX, block_grid, dequantize_block, quantize_block
from engine.parallel import EPGroup, TPGroup
from engine.v4.config import CSA, V4Config
from engine.v4.loader import load_v4
from tests.engine.v4_quant_parity import assert_quantized_equals_hf

BLOCK = (16, 24)  # tiny dims are < 128: blocks that make grids, partial ones included (64 / 24)
FP8_LINEAR = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                        r"|ffn\.(shared_experts|experts\.\d+)\.w[123])\.weight")


def _quantize_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 blocks with power-of-two scales (``scale_fmt: ue8m0``), scales float8_e8m0fnu."""
    out, inp = w.shape
    grid = block_grid(out, inp, BLOCK)
    padded = w.new_zeros(grid[0] * BLOCK[0], grid[1] * BLOCK[1])
    padded[:out, :inp] = w
    tiles = padded.view(grid[0], BLOCK[0], grid[1], BLOCK[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    q = (tiles / scale[:, None, :, None]).view_as(padded)[:out, :inp]
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous(), \
        scale.to(torch.float8_e8m0fnu)


@pytest.fixture(scope="module")
def fp8_ckpts(tiny_v4_ckpt, tmp_path_factory):
    """(FP8 checkpoint, its dequantized float twin, number of FP8 weights)."""
    raw = json.loads((tiny_v4_ckpt / "config.json").read_text())
    state = load_file(str(tiny_v4_ckpt / "model.safetensors"))
    quant, plain, count = {}, {}, 0
    for name, t in state.items():
        if not FP8_LINEAR.fullmatch(name):
            quant[name] = plain[name] = t
            continue
        if count % 2:
            q, scale = _quantize_ue8m0(t)
            quant[name], quant[name.removesuffix("weight") + "scale"] = q, scale
        else:
            q, scale = quantize_block(t, BLOCK)
            quant[name], quant[name + "_scale_inv"] = q, scale
        plain[name] = dequantize_block(q, scale, BLOCK)
        count += 1
    root = tmp_path_factory.mktemp("v4fp8")
    dirs = {}
    for kind, tensors, extra in (
            ("fp8", quant, {"quantization_config": {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "scale_fmt": "ue8m0", "weight_block_size": list(BLOCK)}}),
            ("float", plain, {})):
        out = root / kind
        out.mkdir()
        (out / "config.json").write_text(json.dumps(raw | extra))
        save_file(tensors, str(out / "model.safetensors"))
        dirs[kind] = out
    return dirs["fp8"], dirs["float"], count


def test_fp8_checkpoint_matches_transformers_on_dequantized_weights(fp8_ckpts, tiny_v4_ckpt):
    """Logits of engine/v4 on the FP8 checkpoint equal transformers' on its dequantized
    weights (fp32) within TOL and pick the same greedy tokens; they equal engine/v4's own
    on the float twin exactly (dequantizing at load is the whole difference), and differ
    from the unquantized original (the FP8 rounding is real)."""
    fp8, plain, count = fp8_ckpts
    cfg = V4Config.from_dict(json.loads((fp8 / "config.json").read_text()))
    csa = sum(kind == CSA for kind in cfg.layer_types)
    assert csa and count == cfg.num_hidden_layers * (5 + 3 * (cfg.n_routed_experts + 1)) + csa
    assert_quantized_equals_hf(fp8, plain, tiny_v4_ckpt)


@pytest.mark.parametrize("group", [{"tp": TPGroup(rank=1, size=2)},
                                   {"ep": EPGroup(rank=1, size=4)}], ids=["tp", "ep"])
def test_a_tp_or_ep_rank_holds_its_part_dequantized(fp8_ckpts, group):
    """TP rank 1 of 2 (dequantize whole, keep the part) and EP rank 1 of 4 (its experts,
    per-expert FP8 tensors) hold exactly what they hold from the float twin (loading needs
    no collectives)."""
    fp8, plain, _ = fp8_ckpts
    want = load_v4(plain, **group).state_dict()
    got = load_v4(fp8, **group).state_dict()
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def test_refuses_unknown_expert_dtypes_and_w8a8(fp8_ckpts, tmp_path):
    """An ``expert_dtype`` other than fp4 / fp8 / bf16 (top-level or in
    ``quantization_config``) and int8 W8A8 are refused by name before any weight is read
    (FP4 experts load: tests/engine/test_v4_fp4.py)."""
    fp8, _, _ = fp8_ckpts
    raw = json.loads((fp8 / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(fp8 / "model.safetensors")
    qc = raw["quantization_config"]
    for bad, words in (({"expert_dtype": "int4"}, "expert_dtype is 'int4'"),
                       ({"quantization_config": qc | {"expert_dtype": "nvfp4"}},
                        "expert_dtype is 'nvfp4'"),
                       ({"quantization_config": {"quant_method": "compressed-tensors"}},
                        "quantization_config")):
        (tmp_path / "config.json").write_text(json.dumps(raw | bad))
        with pytest.raises(CheckpointError, match=words):
            load_v4(tmp_path)


def test_refuses_scales_the_config_does_not_declare(fp8_ckpts, tmp_path):
    """FP8 weights without ``quantization_config``, a ``weight_block_size`` other than the
    written one, and a packed (int8) expert weight with a scale are errors naming the
    tensor, never raw bytes read as weights."""
    fp8, _, _ = fp8_ckpts
    raw = json.loads((fp8 / "config.json").read_text())
    state = load_file(str(fp8 / "model.safetensors"))
    (tmp_path / "model.safetensors").symlink_to(fp8 / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in raw.items() if k != "quantization_config"}))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_v4(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        raw | {"quantization_config": raw["quantization_config"]
               | {"weight_block_size": [128, 128]}}))
    with pytest.raises(CheckpointError, match="weight_block_size"):
        load_v4(tmp_path)
    packed = tmp_path / "packed"
    packed.mkdir()
    name = "layers.2.ffn.experts.3.w1.weight"
    state[name] = torch.zeros(state[name].shape[0], state[name].shape[1] // 2, dtype=torch.int8)
    save_file(state, str(packed / "model.safetensors"))
    (packed / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_v4(packed)

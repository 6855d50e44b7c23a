"""DeepSeek-V4 FP4 routed experts (``expert_dtype: fp4``, engine/quant/mxfp4.py): the
dequantizer against hand-computed values, and the tiny checkpoint of ``orch model init-tiny
--arch deepseek_v4`` stored as the release stores it (routed experts packed MXFP4 with
``<module>.scale`` e8m0 per 32 inputs, packed by :func:`_pack_mxfp4` below from the format in
docs/quantization.md "DeepSeek-V4"; the other FP8 linears e4m3 128-style blocks) loaded by
engine/v4 against transformers' ``DeepseekV4ForCausalLM`` (fp32, eager) on the dequantized
weights written as a float checkpoint."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_config import CheckpointError
from engine.parallel import EPGroup
from engine.quant.fp8_block import dequantize_block, quantize_block
from engine.quant.mxfp4 import dequantize_mxfp4
from engine.v4.loader import load_v4
from tests.engine.v4_quant_parity import assert_quantized_equals_hf

BLOCK = (16, 24)  # FP8 blocks of the tiny dims (as test_v4_fp8.py)
ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
FP8_LINEAR = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                        r"|ffn\.shared_experts\.w[123])\.weight")


def _e2m1(code: int) -> float:
    """The value of e2m1 ``code`` from its bits (OCP MX v1.0: sign 3, exponent 2-1 with bias
    1, mantissa 0; exponent 0 subnormal)."""
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def _pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` as the release stores an FP4 expert: int8 ``[out, in / 2]`` (column
    ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high one) and float8_e8m0fnu
    ``[out, in / 32]`` power-of-two scales (amax of the 32 rounded up to 6 x 2^k); each weight
    the nearest e2m1 value of ``w / scale``."""
    out, inp = w.shape
    blocks = w.view(out, inp // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-30) / 6)))
    x = (blocks / scale[..., None]).view(out, inp)
    values = torch.tensor([_e2m1(c) for c in range(16)])
    codes = (x[..., None] - values).abs().argmin(-1)  # ties: the lower code (+0 for 0)
    byte = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def test_every_code_both_nibbles_every_scale():
    """Byte ``16 h + l`` of row ``k`` is (e2m1(l), e2m1(h)) x 2^k for every code pair and
    k in -3..3; float4_e2m1fn_x2 / int8 / uint8 bytes and uint8 / e8m0 scales agree."""
    byte = torch.arange(256, dtype=torch.uint8)
    exps = range(-3, 4)
    packed = byte.repeat(len(exps), 1)  # [7, 256] -> 512 columns, 16 scales per row
    scale = torch.tensor([[127 + k] * 16 for k in exps], dtype=torch.uint8)
    want = torch.tensor([[_e2m1(b & 15) * 2.0 ** k if i == 0 else _e2m1(b >> 4) * 2.0 ** k
                          for b in range(256) for i in (0, 1)] for k in exps])
    for p in (packed, packed.view(torch.int8), packed.view(torch.float4_e2m1fn_x2)):
        for s in (scale, scale.view(torch.float8_e8m0fnu)):
            assert torch.equal(dequantize_mxfp4(p, s), want)
    assert dequantize_mxfp4(torch.tensor([[0x7A] * 16], dtype=torch.uint8),
                            torch.tensor([[128]], dtype=torch.uint8))[0, :2].tolist() == [-2, 12]
    # NOTE: -0.0 (code 8) is kept signed
    assert torch.signbit(dequantize_mxfp4(torch.tensor([[8] * 16], dtype=torch.uint8),
                                          torch.tensor([[127]], dtype=torch.uint8))[0, 0])


def test_dequantizer_refuses_bad_shapes_and_nan_scales():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"needs \(2, 1\)"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(packed, torch.full((2, 1), 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dtype"):
        dequantize_mxfp4(packed.float(), torch.zeros(2, 1, dtype=torch.uint8))


def test_packer_round_trips_fp4_representable_weights():
    """The test's packer is the dequantizer's inverse on e2m1 x 2^k weights."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=g)
    codes[:, ::32] = 7  # a 6 in each block: its amax is 6 x 2^k, so its scale is 2^k
    w = torch.tensor([[_e2m1(int(c)) for c in row] for row in codes])
    w = w * torch.exp2(torch.randint(-3, 4, (5, 2), generator=g).float()).repeat_interleave(32, 1)
    assert torch.equal(dequantize_mxfp4(*_pack_mxfp4(w)), w)


@pytest.fixture(scope="module")
def fp4_ckpts(tiny_v4_ckpt, tmp_path_factory):
    """(release-format checkpoint, its dequantized float twin): routed experts MXFP4, the
    other FP8 linears e4m3 blocks with float32 ``weight_scale_inv``; config.json as the
    release's (top-level ``expert_dtype: fp4``, FP8 ``quantization_config``)."""
    raw = json.loads((tiny_v4_ckpt / "config.json").read_text())
    quant, plain, routed = {}, {}, 0
    for name, t in load_file(str(tiny_v4_ckpt / "model.safetensors")).items():
        if ROUTED.fullmatch(name):
            q, scale = _pack_mxfp4(t)
            quant[name], quant[name.removesuffix("weight") + "scale"] = q, scale
            plain[name] = dequantize_mxfp4(q, scale)
            routed += 1
        elif FP8_LINEAR.fullmatch(name):
            q, scale = quantize_block(t, BLOCK)
            quant[name], quant[name + "_scale_inv"] = q, scale
            plain[name] = dequantize_block(q, scale, BLOCK)
        else:
            quant[name] = plain[name] = t
    assert routed == 3 * raw["n_routed_experts"] * raw["num_hidden_layers"]
    root = tmp_path_factory.mktemp("v4fp4")
    dirs = {}
    for kind, tensors, extra in (
            ("fp4", quant, {"expert_dtype": "fp4", "quantization_config": {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "scale_fmt": "ue8m0", "weight_block_size": list(BLOCK)}}),
            ("float", plain, {})):
        out = root / kind
        out.mkdir()
        (out / "config.json").write_text(json.dumps(raw | extra))
        save_file(tensors, str(out / "model.safetensors"))
        dirs[kind] = out
    return dirs["fp4"], dirs["float"]


def test_fp4_checkpoint_matches_transformers_on_dequantized_weights(fp4_ckpts, tiny_v4_ckpt):
    """Logits of engine/v4 on the release-format checkpoint equal transformers' on its
    dequantized weights (fp32) within TOL with the same greedy tokens, equal engine/v4's own
    on the float twin exactly, and differ from the unquantized original (the FP4 rounding is
    real: every routed expert weight differs from its original somewhere)."""
    fp4, plain = fp4_ckpts
    ours, original = assert_quantized_equals_hf(fp4, plain, tiny_v4_ckpt)
    before = original.state_dict()
    for name, t in ours.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert (t - before[name]).abs().amax(dim=(1, 2)).min() > 0, name


def test_an_ep_rank_holds_its_experts_dequantized(fp4_ckpts, tmp_path):
    """EP rank 1 of 4, ``expert_dtype`` inside ``quantization_config`` (where transformers
    moves it): the rank holds exactly what it holds from the float twin."""
    fp4, plain = fp4_ckpts
    raw = json.loads((fp4 / "config.json").read_text())
    (tmp_path / "model.safetensors").symlink_to(fp4 / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in raw.items() if k != "expert_dtype"}
        | {"quantization_config": raw["quantization_config"] | {"expert_dtype": "fp4"}}))
    ep = {"ep": EPGroup(rank=1, size=4)}
    want = load_v4(plain, **ep).state_dict()
    got = load_v4(tmp_path, **ep).state_dict()
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def test_inconsistent_fp4_checkpoints_are_refused(fp4_ckpts, tmp_path):
    """FP4 experts without ``expert_dtype: fp4``, ``expert_dtype: fp4`` with an e4m3 routed
    expert or a wrong scale shape: errors naming the tensor, never raw bytes read."""
    fp4, _ = fp4_ckpts
    raw = json.loads((fp4 / "config.json").read_text())
    state = load_file(str(fp4 / "model.safetensors"))
    (tmp_path / "model.safetensors").symlink_to(fp4 / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {k: v for k, v in raw.items() if k != "expert_dtype"}))
    with pytest.raises(CheckpointError, match="expert_dtype fp4"):
        load_v4(tmp_path)
    name = "layers.1.ffn.experts.2.w2.weight"
    for bad, words in (
            ({name: torch.zeros(64, 32, dtype=torch.float8_e4m3fn)}, "packed MXFP4"),
            ({name.removesuffix("weight") + "scale": torch.zeros(64, 2, dtype=torch.uint8)},
             r"needs \(64, 1\)")):
        out = tmp_path / str(len(words))
        out.mkdir()
        save_file(state | bad, str(out / "model.safetensors"))
        (out / "config.json").write_text(json.dumps(raw))
        with pytest.raises(CheckpointError, match=re.escape(name)):
            load_v4(out)
        with pytest.raises(CheckpointError, match=words):
            load_v4(out)

"""Quantized tiny checkpoints end to end in the engine: FP8 block (several shards) and W8A8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.kernels import KERNELS
from engine.layout import rule_for
from engine.loader import load_weights
from engine.model_config import CheckpointError
from engine.model import build_model
from engine.model_config import ModelConfig, load_model_config
from engine.parallel import EPGroup, TPGroup
from engine.quant.fp8_block import Fp8BlockLinear, dequantize_block
from engine.quant.linear import Int8Linear, W8A8MLP
from engine.quant.load import CheckpointTensors, quant_plan
from engine.quant.writer import quantize_checkpoint
from engine.runner import ModelRunner, SeqStep
from orchestrator.cli import main as orch_main
from orchestrator.tiny_model import tiny_config_dict, tiny_state_dict

BLOCK = 16
PROMPTS = [torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in range(9, 41, 2)]  # 16 prompts of 9..39 tokens


def _quantize(src, dst, scheme, shard_mb=20):
    assert orch_main(["model", "quantize", str(src), str(dst), "--scheme", scheme,
                      "--shard-mb", str(shard_mb)]) == 0
    return dst


@pytest.fixture(scope="module")
def fp8_ckpt(tiny_ckpt, tmp_path_factory):
    return _quantize(tiny_ckpt, tmp_path_factory.mktemp("fp8"), "fp8-block")


@pytest.fixture(scope="module")
def w8a8_ckpt(tiny_ckpt, tmp_path_factory):
    return _quantize(tiny_ckpt, tmp_path_factory.mktemp("w8a8"), "w8a8")


@pytest.fixture(scope="module")
def dequantized_ckpt(fp8_ckpt, tmp_path_factory):
    """The FP8 checkpoint's weights dequantized to fp32, written as a plain float checkpoint."""
    out = tmp_path_factory.mktemp("deq")
    state = {}
    with CheckpointTensors(fp8_ckpt) as tensors:
        for name in tensors.names():
            if name.endswith("weight_scale_inv"):
                continue
            t = tensors.read(name, [(0, n) for n in tensors.shape(name)])
            if tensors.has(f"{name}_scale_inv"):
                scale = tensors.read(f"{name}_scale_inv", [(0, n) for n in
                                                           tensors.shape(f"{name}_scale_inv")])
                t = dequantize_block(t, scale, (128, 128))
            state[name] = t
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((fp8_ckpt / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _runner(ckpt, **kw) -> ModelRunner:
    return ModelRunner(ckpt, num_kv_blocks=len(PROMPTS) * 3 + 4, block_size=BLOCK, **kw)


def _last_logits(runner: ModelRunner) -> torch.Tensor:
    """``[16, vocab]`` last-token logits of the 16 prompts, prefilled in one batch."""
    steps = [SeqStep(f"r{i}", tuple(p), 0, tuple(range(3 * i, 3 * i + 3)))
             for i, p in enumerate(PROMPTS)]
    return runner.execute(steps)


def test_fp8_checkpoint_is_sharded_deepseek_style(fp8_ckpt):
    files = sorted(p.name for p in fp8_ckpt.glob("*.safetensors"))
    index = json.loads((fp8_ckpt / "model.safetensors.index.json").read_text())
    assert len(files) >= 3 and set(index["weight_map"].values()) == set(files)
    with CheckpointTensors(fp8_ckpt) as t:
        name = "model.layers.0.self_attn.q_b_proj.weight"  # [4 heads * 48, 48]
        assert t.read(name, [(0, 1), (0, 1)]).dtype == torch.float8_e4m3fn
        assert t.shape(name + "_scale_inv") == (2, 1)  # ceil(192/128), ceil(48/128)
        assert not t.has("lm_head.weight_scale_inv")
        assert not t.has("model.layers.1.mlp.gate.weight_scale_inv")


@pytest.mark.parametrize("fp8_storage", ["dequantize", "fp8"])
def test_fp8_logits_equal_the_dequantized_model(fp8_ckpt, dequantized_ckpt, fp8_storage):
    runner = _runner(fp8_ckpt, fp8_storage=fp8_storage)
    kept = [m for m in runner.model.modules() if isinstance(m, Fp8BlockLinear)]
    # 3 layers x 4 attention linears (kv_b_proj stays float), 1 dense + 2 x 9 expert MLPs
    assert len(kept) == (0 if fp8_storage == "dequantize" else 3 * 4 + 3 * (1 + 2 * 9))
    torch.testing.assert_close(_last_logits(runner), _last_logits(_runner(dequantized_ckpt)),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("ckpt_name", ["fp8_ckpt", "w8a8_ckpt"])
def test_tp_shards_of_quantized_weights_equal_slices_of_the_whole(ckpt_name, request):
    """TP rank 1 of 2 (loading only: partial blocks, shards starting mid-block)."""
    ckpt = request.getfixturevalue(ckpt_name)
    config, kernels = load_model_config(ckpt), KERNELS.resolve("cpu")
    whole = build_model(config, TPGroup(), kernels, torch.float32, torch.device("cpu"))
    load_weights(whole, ckpt, TPGroup())
    tp = TPGroup(rank=1, size=2)
    part = build_model(config, tp, kernels, torch.float32, torch.device("cpu"))
    load_weights(part, ckpt, tp)
    full = dict(whole.named_parameters())
    for name, p in part.named_parameters():
        index = rule_for(name).local_slices(tuple(full[name].shape), tp.rank, part.layout)
        expect = full[name][index]
        assert torch.equal(p, expect), name


def _int8_parts(model):
    """{checkpoint weight name: (int8 weight, scale)} of every int8 module."""
    parts = {}
    for name, module in model.named_modules():
        if isinstance(module, W8A8MLP):
            parts.update((f"{name}.{p}.weight", ws) for p, ws in module.checkpoint_parts().items())
        elif isinstance(module, Int8Linear):
            parts[f"{name}.weight"] = (module.weight, module.weight_scale)
    return parts


@pytest.mark.parametrize("ep, num_experts", [(EPGroup(), 8), (EPGroup(rank=3, size=4), 2)])
def test_tp_and_ep_shards_of_int8_weights_and_scales_equal_slices_of_the_whole(w8a8_ckpt, ep,
                                                                               num_experts):
    """TP rank 1 of 2, without EP and as EP rank 3 of 4 (dp2 x tp2: experts 6, 7 whole)."""
    config, kernels = load_model_config(w8a8_ckpt), KERNELS.resolve("cpu")
    plan = quant_plan(w8a8_ckpt, config.quantization)
    models = []
    for tp, ep_group in ((TPGroup(), EPGroup()), (TPGroup(rank=1, size=2), ep)):
        models.append(build_model(config, tp, kernels, torch.float32, torch.device("cpu"), plan,
                                  ep=ep_group))
        load_weights(models[-1], w8a8_ckpt, tp)
    whole, part = (_int8_parts(m) for m in models)
    assert len(part) == 3 * 4 + 3 * (1 + 2 * (num_experts + 1))
    for name, (w, s) in part.items():
        index = rule_for(name).local_slices(tuple(whole[name][0].shape), 1, models[1].layout)
        assert torch.equal(w, whole[name][0][index]), name
        assert torch.equal(s, whole[name][1][index[0]]), name  # per output channel


def test_fp8_storage_refuses_tp_shards_off_block_boundaries(fp8_ckpt):
    config = load_model_config(fp8_ckpt)
    tp = TPGroup(rank=1, size=2)
    plan = quant_plan(fp8_ckpt, config.quantization, "fp8")
    model = build_model(config, tp, KERNELS.resolve("cpu"), torch.float32,
                        torch.device("cpu"), plan)
    with pytest.raises(CheckpointError, match="fp8_storage: dequantize"):
        load_weights(model, fp8_ckpt, tp)


def test_fp8_storage_tp_shards_on_block_boundaries_equal_slices_of_the_whole(tmp_path):
    """A config whose TP parts are 128-block multiples at tp 2 (16 heads, expert width 256):
    rank 1 keeps FP8 weights + its scale blocks, equal to its slice of the dequantized whole."""
    raw = tiny_config_dict(hidden_size=256, num_heads=16, vocab_size=512)
    raw.update(intermediate_size=512, moe_intermediate_size=256)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(raw))
    save_file(tiny_state_dict(ModelConfig.from_dict(raw), seed=3), str(src / "model.safetensors"))
    ckpt = quantize_checkpoint(src, tmp_path / "fp8", "fp8-block")
    config, kernels, tp = load_model_config(ckpt), KERNELS.resolve("cpu"), TPGroup(1, 2)
    whole = build_model(config, TPGroup(), kernels, torch.float32, torch.device("cpu"))
    load_weights(whole, ckpt, TPGroup())
    part = build_model(config, tp, kernels, torch.float32, torch.device("cpu"),
                       quant_plan(ckpt, config.quantization, "fp8"))
    load_weights(part, ckpt, tp)
    full = dict(whole.named_parameters())
    kept = [(n, m) for n, m in part.named_modules() if isinstance(m, Fp8BlockLinear)]
    assert len(kept) == 3 * 4 + 3 * (1 + 2 * 9)
    for name, module in kept:
        w = full[f"{name}.weight"]
        expect = w[rule_for(f"{name}.weight").local_slices(tuple(w.shape), tp.rank, part.layout)]
        got = dequantize_block(module.weight, module.weight_scale_inv, (128, 128))
        assert torch.equal(got, expect), name


def test_w8a8_model_uses_int8_modules_and_stays_close_to_fp32(w8a8_ckpt, tiny_ckpt):
    runner = _runner(w8a8_ckpt)
    kinds = [type(m) for m in runner.model.modules()]
    # 3 layers: 1 dense MLP, 2 x (8 experts + shared); attention: 4 int8 linears per layer
    assert kinds.count(W8A8MLP) == 1 + 2 * 9 and kinds.count(Int8Linear) == 3 * 4
    quant, ref = _last_logits(runner), _last_logits(_runner(tiny_ckpt))
    cos = F.cosine_similarity(quant, ref, dim=-1)  # [16]
    assert cos.min() >= 0.99, cos
    assert (quant.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_quantize_refuses_a_used_destination_and_bad_arguments(tiny_ckpt, fp8_ckpt, tmp_path,
                                                             capsys):
    """A folder that holds shards already is refused (its old shards would be read with the
    new ones); like a quantized source and --shard-mb 0, in one line with exit 2."""
    shards = sorted(p.name for p in fp8_ckpt.glob("*.safetensors"))
    for src, dst, mb, said in (
            (tiny_ckpt, fp8_ckpt, 20, "exists and is not an empty folder"),
            (fp8_ckpt, tmp_path / "new", 20, "is quantized already (fp8)"),
            (tiny_ckpt, tmp_path / "zero", 0, "use --shard-mb 1 or more")):
        assert orch_main(["model", "quantize", str(src), str(dst), "--scheme", "w8a8",
                          "--shard-mb", str(mb)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("orch model quantize: ") and said in err, err
    assert sorted(p.name for p in fp8_ckpt.glob("*.safetensors")) == shards


def test_scales_without_quantization_config_are_refused(fp8_ckpt, tmp_path):
    ckpt = shutil.copytree(fp8_ckpt, tmp_path / "noqc")
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight_scale_inv.*no quantization_config"):
        _runner(ckpt)


@pytest.mark.parametrize("fp8_storage", ["dequantize", "fp8"])
def test_a_block_size_other_than_the_written_one_is_refused(fp8_ckpt, tmp_path, fp8_storage):
    ckpt = shutil.copytree(fp8_ckpt, tmp_path / "blocks")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv has shape .* with "
                                              r"weight_block_size \[64, 64\] needs"):
        _runner(ckpt, fp8_storage=fp8_storage)


def test_int8_weights_under_an_fp8_config_are_refused(w8a8_ckpt, tmp_path):
    ckpt = shutil.copytree(w8a8_ckpt, tmp_path / "mixed")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight_scale .*config.json says fp8_block"):
        _runner(ckpt)


def test_llmcompressor_written_config_loads_the_same_tensors(w8a8_ckpt, tmp_path):
    """llm-compressor 0.14 writes the same tensor layout (per-expert int8 ``weight``, float32
    ``weight_scale [out, 1]``, no zero points: checked by hand, docs/quantization.md) under
    its own config; its ``ignore`` list (router gates, lm_head) changes nothing."""
    from tests.engine.test_quant_formats import LLMCOMPRESSOR_W8A8

    ckpt = shutil.copytree(w8a8_ckpt, tmp_path / "llmc")
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = LLMCOMPRESSOR_W8A8
    (ckpt / "config.json").write_text(json.dumps(config))
    assert torch.equal(_last_logits(_runner(ckpt)), _last_logits(_runner(w8a8_ckpt)))


def test_written_checkpoints_are_readable_by_other_users(tiny_ckpt, fp8_ckpt):
    """Ranks may run as another user or read a shared folder: shards are 0644 like config.json
    (safetensors itself writes a private 0600 file)."""
    for folder in (tiny_ckpt, fp8_ckpt):
        shards = list(Path(folder).glob("*.safetensors"))
        assert shards and all(p.stat().st_mode & 0o777 == 0o644 for p in shards), folder



def test_glm_shared_indexer_w8a8_checkpoint_stays_close(tiny_glm_shared_ckpt, tmp_path):
    """GLM-5.2-style (shared indexer layers hold no indexer weights): `orch model quantize`
    writes W8A8, the engine loads it and stays close to the float model. NOTE: the median, not
    the minimum: past index_topk a quantization error can flip which tokens a query selects
    (a discontinuous top-k), moving that prompt's logits further (one of 16 here, cos 0.89)."""
    runner = _runner(_quantize(tiny_glm_shared_ckpt, tmp_path / "w8a8", "w8a8"))
    assert [layer.self_attn.indexer is None for layer in runner.model.model.layers] \
        == [False, True, False, True]
    quant, ref = _last_logits(runner), _last_logits(_runner(tiny_glm_shared_ckpt))
    cos = F.cosine_similarity(quant, ref, dim=-1)  # [16]
    assert cos.median() >= 0.99 and cos.min() >= 0.8, cos
    assert (quant.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_glm_shared_indexer_fp8_kept_equals_dequantized(tiny_glm_shared_ckpt, tmp_path):
    """The FP8-block GLM-5.2-style checkpoint: FP8 weights kept 1 byte give the logits of the
    same weights dequantized at load."""
    ckpt = _quantize(tiny_glm_shared_ckpt, tmp_path / "fp8", "fp8-block")
    kept = _runner(ckpt, fp8_storage="fp8")
    assert any(isinstance(m, Fp8BlockLinear) for m in kept.model.modules())
    torch.testing.assert_close(_last_logits(kept),
                               _last_logits(_runner(ckpt, fp8_storage="dequantize")),
                               rtol=0, atol=1e-5)

"""Our runtime vs HF transformers' DeepseekV3ForCausalLM on the same tiny random checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from tests.engine.engine_drive import blocks_for, generate_greedy
from engine.runner import ModelRunner, SeqStep

BLOCK = 16


def _hf(ckpt):
    model, info = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 129280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "tiny_ckpt_no_qlora"])
def test_prefill_logits_match_hf(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    hf = _hf(ckpt)
    runner = ModelRunner(ckpt, num_kv_blocks=32, block_size=BLOCK)
    for n in (1, 17, 300):
        prompt = _prompt(n, seed=n)
        ours = runner.execute([SeqStep("p", tuple(prompt), 0, blocks_for(0, n, BLOCK))])[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        assert ours.shape == ref.shape == (129280,)
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"{ckpt_name} prompt {n}: max |diff| {diff}"


@pytest.mark.parametrize("ckpt_name", ["tiny_ckpt", "tiny_ckpt_no_qlora"])
def test_greedy_32_tokens_match_hf_generate(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    hf = _hf(ckpt)
    runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=BLOCK)
    prompt = _prompt(17, seed=7)
    ours, _ = generate_greedy(runner, prompt, 32, blocks_for(0, 17 + 32, BLOCK))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0)[0, 17:].tolist()
    assert len(set(ours)) > 1, "degenerate model: every greedy token is the same"
    assert ours == ref


def test_yarn_is_exercised(tiny_ckpt):
    """The tiny YaRN config really differs from plain rope at our prompt lengths."""
    from engine.model_config import load_model_config
    from engine.rotary import RotaryEmbedding, softmax_scale

    cfg = load_model_config(tiny_ckpt)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    assert not torch.allclose(RotaryEmbedding(cfg).inv_freq, plain)
    assert softmax_scale(cfg) != pytest.approx(48 ** -0.5)


def test_deepseek_v2_matches_hf(tmp_path):
    """V2 flavour: softmax router, group_limited_greedy, no bias, plain q_proj, mscale 0.707."""
    from transformers import DeepseekV2ForCausalLM

    from orchestrator.tiny_model import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path / "v2", seed=5, q_lora_rank=None, deepseek_v2=True)
    hf, info = DeepseekV2ForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    runner = ModelRunner(ckpt, num_kv_blocks=32, block_size=BLOCK)
    assert runner.model_config.scoring_func == "softmax"
    for n in (17, 300):
        prompt = _prompt(n, seed=n + 1)
        ours = runner.execute([SeqStep("p", tuple(prompt), 0, blocks_for(0, n, BLOCK))])[0]
        with torch.no_grad():
            ref = hf.eval()(torch.tensor([prompt])).logits[0, -1].float()
        assert (ours - ref).abs().max().item() <= 1e-4, f"prompt {n}"
    prompt = _prompt(17, seed=9)
    ours, _ = generate_greedy(runner, prompt, 16, blocks_for(20, 17 + 16, BLOCK))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False, pad_token_id=0)[0, 17:].tolist()
    assert ours == ref

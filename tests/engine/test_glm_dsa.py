"""GLM-5 (``glm_moe_dsa``) vs transformers' GlmMoeDsaForCausalLM, both indexer variants.

``tiny_glm_ckpt`` (every layer a full indexer, interleaved indexer rope) and
``tiny_glm_shared_ckpt`` (GLM-5.2-style: layers 1 and 3 "shared", no indexer, reusing the top-k
of layers 0 and 2) keep index_topk = 32 tokens per query, fewer than the 300-token prompt and
the decode contexts, so the selection changes the result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from engine.kernels import KERNELS
from engine.model_config import ModelConfig, UnsupportedModelError
from engine.rotary import apply_rotary_half
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import tiny_config_dict
from tests.engine.engine_drive import blocks_for, generate_greedy

BLOCK, TOPK = 16, 32
VARIANTS = ["tiny_glm_ckpt", "tiny_glm_shared_ckpt"]


@pytest.fixture(scope="module", params=VARIANTS)
def pair(request):
    """(checkpoint, our runner, transformers' model) of one variant."""
    ckpt = request.getfixturevalue(request.param)
    hf, info = GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                    output_loading_info=True)
    # NOTE: HF skips a real checkpoint's MTP layer (model.layers.N.*) by a fixed N
    mtp = f"model.layers.{hf.config.num_hidden_layers}."
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith(mtp)]
    assert not info["missing_keys"] and not unexpected, info
    assert hf.config.index_topk == TOPK
    return ckpt, ModelRunner(ckpt, num_kv_blocks=48, block_size=BLOCK), hf.eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 129280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefill(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    return runner.execute([SeqStep("p", tuple(prompt), 0, blocks_for(0, len(prompt), BLOCK))])[0]


def _hf_last(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1].float()


def test_shared_layers_have_no_indexer_and_no_index_k(tiny_glm_shared_ckpt):
    runner = ModelRunner(tiny_glm_shared_ckpt, num_kv_blocks=8, block_size=BLOCK)
    assert runner.model_config.indexer_types == ("full", "shared", "full", "shared")
    assert runner.model_config.indexer_rope == "interleaved"
    layers = runner.model.model.layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [True, False] * 2
    assert not any(".indexer." in n for n, _ in layers[1].named_parameters())
    assert [len(runner.kv_cache.layer_buffers(i)) for i in range(4)] == [3, 2, 3, 2]
    assert runner.kv_cache.index_caches[1] is None
    assert runner.kv_spec.layer_buffer_names(3) == ("k", "v")


@pytest.mark.parametrize("n", [1, 17, 300])
def test_prefill_logits_match_hf(pair, n):
    _, runner, hf = pair
    prompt = _prompt(n, seed=n)
    diff = (_prefill(runner, prompt) - _hf_last(hf, prompt)).abs().max().item()
    assert diff <= 1e-4, f"prompt {n}: max |diff| {diff}"


def test_chunked_prefill_matches_hf_and_one_shot(pair):
    """Chunks select over cached prefix + chunk; shared layers reuse each chunk's selection."""
    _, runner, hf = pair
    prompt = _prompt(300, seed=11)
    one_tokens, one_logits = generate_greedy(runner, prompt, 4, blocks_for(0, 304, BLOCK))
    tokens, logits = generate_greedy(runner, prompt, 4, blocks_for(20, 304, BLOCK), chunk=72)
    assert tokens == one_tokens
    for a, b in zip(logits, one_logits, strict=True):
        assert (a - b).abs().max().item() <= 1e-5
    assert (logits[0] - _hf_last(hf, prompt)).abs().max().item() <= 1e-4


def test_greedy_32_tokens_match_hf_generate(pair):
    """Prompt 48 > index_topk: every decode step selects from more tokens than it keeps."""
    _, runner, hf = pair
    prompt = _prompt(48, seed=7)
    ours, _ = generate_greedy(runner, prompt, 32, blocks_for(0, 48 + 32, BLOCK))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0)[0, 48:].tolist()
    assert len(set(ours)) > 1, "degenerate model: every greedy token is the same"
    assert ours == ref


def test_interleaved_indexer_rope_matters(tiny_glm_ckpt):
    """V3.2's half-split indexer rope on a GLM-5 checkpoint changes the logits past top-k."""
    runner = ModelRunner(tiny_glm_ckpt, num_kv_blocks=24, block_size=BLOCK)
    prompt = _prompt(300, seed=300)
    right = _prefill(runner, prompt)
    for layer in runner.model.model.layers:
        layer.self_attn.indexer._apply_rope = apply_rotary_half
    assert (_prefill(runner, prompt) - right).abs().max().item() > 1e-3


def test_one_write_per_buffer_per_layer_per_step(tiny_glm_shared_ckpt):
    """Full layers write K, V, index_k; shared layers K and V only; each buffer once."""
    base = KERNELS.resolve("cpu")
    calls: list[int] = []

    def counting(entries, caches, slots):
        calls.append(len(caches))
        return base.reshape_and_cache(entries, caches, slots)

    runner = ModelRunner(tiny_glm_shared_ckpt, num_kv_blocks=16, block_size=BLOCK,
                         kernels=dataclasses.replace(base, reshape_and_cache=counting))
    buffers = [b for i in range(4) for b in runner.kv_cache.layer_buffers(i)]
    for step in ([SeqStep("a", tuple(range(40)), 0, blocks_for(0, 41, BLOCK))],
                 [SeqStep("a", (7,), 40, blocks_for(0, 41, BLOCK))]):
        calls.clear()
        before = [buf._version for buf in buffers]
        runner.execute(step)
        assert calls == [3, 2, 3, 2]
        assert [b._version - v for b, v in zip(buffers, before, strict=True)] == [1] * 10


@pytest.mark.parametrize("extra", [{"index_topk_freq": 3}, {"index_topk_freq": 2,
                                                             "index_skip_topk_offset": 1},
                                   {"index_topk_pattern": "FSFFSS"}])
def test_indexer_types_derived_as_transformers(extra):
    raw = {**tiny_config_dict(glm_moe_dsa=True, num_layers=6), **extra}
    ours = ModelConfig.from_dict(raw)
    assert list(ours.indexer_types) == GlmMoeDsaConfig(**raw).indexer_types
    assert ours.indexer_layers == tuple(k == "full" for k in ours.indexer_types)


def test_glm_config_fields_and_refusals():
    cfg = ModelConfig.from_dict(tiny_config_dict(glm_moe_dsa=True))
    assert (cfg.indexer_rope, cfg.indexer_types, cfg.rope_theta, cfg.rope_scaling) \
        == ("interleaved", ("full",) * 3, 1e6, None)
    assert cfg.norm_topk_prob and (cfg.n_group, cfg.v_head_dim) == (1, 48)
    with pytest.raises(UnsupportedModelError, match="the first 'full'"):
        ModelConfig.from_dict(tiny_config_dict(glm_moe_dsa=True,
                                               indexer_types=("shared", "full", "full")))
    with pytest.raises(UnsupportedModelError, match="one of \\['full', 'shared'\\] per layer"):
        ModelConfig.from_dict(tiny_config_dict(glm_moe_dsa=True, indexer_types=("full",)))
    with pytest.raises(UnsupportedModelError, match="mlp_layer_types"):
        ModelConfig.from_dict({**tiny_config_dict(glm_moe_dsa=True),
                               "mlp_layer_types": ["sparse", "dense", "sparse"]})

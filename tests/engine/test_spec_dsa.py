"""MTP speculative decoding on sparse-attention checkpoints (DeepSeek-V3.2, GLM-5, GLM-5.2
shared layers): the MTP layer runs its own lightning indexer over its own ``index_k`` cache;
its forward equals transformers' V3.2 decoder layer fed the paper's MTP input; greedy output
with drafts (the module's own, and an oracle's that are kept) equals greedy output without.
Prompts are longer than index_topk (32), so every selection drops tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV32ForCausalLM

from engine.forward_context import build_attention_metadata
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from tests.engine.engine_drive import blocks_for, generate_greedy
from tests.engine.spec_drive import generate_spec_greedy, oracle_drafts_of
from tests.engine.test_spec_decode import _hf_block_output, _rms

BLOCK = 16
CKPTS = ["v32_mtp_ckpt", "tiny_glm_ckpt", "tiny_glm_shared_ckpt"]
PROMPT = torch.randint(0, 129280, (45,), generator=torch.Generator().manual_seed(7)).tolist()
NEW = 10


@pytest.fixture(scope="module")
def v32_mtp_ckpt(tmp_path_factory):
    """DeepSeek-V3.2 (tiny_dsa_ckpt's shapes) with an MTP module (GLM-5's tiny ones ship one)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("v32_mtp"), seed=3, deepseek_v32=True,
                                 mtp_layers=1)


@pytest.fixture(scope="module", params=CKPTS)
def case(request):
    """(checkpoint, plain greedy tokens of PROMPT) of one sparse-attention checkpoint."""
    torch.set_num_threads(1)
    ckpt = request.getfixturevalue(request.param)
    plain = ModelRunner(ckpt, num_kv_blocks=8, block_size=BLOCK)
    return ckpt, generate_greedy(plain, PROMPT, NEW, blocks_for(0, 64, BLOCK), chunk=20)[0]


def test_mtp_layer_has_its_own_indexer_and_index_k(case):
    ckpt, _ = case
    runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=BLOCK, num_speculative_tokens=1)
    n = runner.model_config.num_hidden_layers
    assert runner.model.mtp.self_attn.indexer is not None
    assert runner.kv_spec.has_index_k(n) and len(runner.kv_cache.layer_buffers(n)) == 3
    table = blocks_for(0, 64, BLOCK)
    runner.execute([SeqStep("p", tuple(PROMPT), 0, table, next_token_id=5)])
    # NOTE: every prompt row's next token is known: the MTP layer cached all 45 keys
    index_k = runner.kv_cache.index_caches[n].view(-1, runner.kv_spec.index_head_dim)
    assert bool((index_k[:len(PROMPT)].abs().sum(-1) > 0).all())
    assert not bool(index_k[len(PROMPT):].any())


def test_v32_mtp_forward_matches_hf_sparse_block(v32_mtp_ckpt):
    """g = Block(eh_proj([enorm(Emb t_{i+1}); hnorm(h_i)])) with transformers' V3.2 decoder
    layer (its indexer and top-k sparse attention) as the block, prefill and decode rows."""
    runner = ModelRunner(v32_mtp_ckpt, num_kv_blocks=8, block_size=BLOCK,
                         num_speculative_tokens=1)
    n, prompt = runner.model_config.num_hidden_layers, PROMPT
    w = load_file(str(v32_mtp_ckpt / "model.safetensors"))
    p = f"model.layers.{n}."
    table = blocks_for(0, 64, BLOCK)
    with torch.inference_mode():
        ids, meta = runner._inputs([SeqStep("p", tuple(prompt), 0, table)])
        h = runner.model(ids, meta, runner.kv_cache, return_hidden=True)  # [T, H]
        e = w["model.embed_tokens.weight"][prompt[1:]]
        x = torch.cat([_rms(e, w[p + "enorm.weight"]), _rms(h[:-1], w[p + "hnorm.weight"])],
                      -1) @ w[p + "eh_proj.weight"].T
        ours = []
        for rows, ctx in ((len(prompt) - 3, 0), (1, len(prompt) - 3), (1, len(prompt) - 2)):
            mmeta = build_attention_metadata([rows], [ctx], [table], BLOCK)
            emb = runner.model.model.embed_tokens(torch.tensor(prompt[1 + ctx:1 + ctx + rows]))
            cos, sin = runner.model.rotary.cos_sin(mmeta.positions, emb.dtype)
            ours.append(runner.model.mtp.forward_mtp(emb, h[ctx:ctx + rows], cos, sin, mmeta,
                                                     runner.kv_cache.layer_buffers(n)))
    dense = runner.model_config.first_k_dense_replace
    ref = _hf_block_output(v32_mtp_ckpt, x, n, DeepseekV32ForCausalLM,
                           mlp_layer_types=["dense"] * dense + ["sparse"] * (n + 1 - dense))
    assert (torch.cat(ours) - ref).abs().max() < 1e-4


@pytest.mark.parametrize("oracle", [False, True])
def test_spec_greedy_equals_plain_greedy(case, monkeypatch, oracle):
    ckpt, expected = case
    if oracle:
        # NOTE: wrong every 4th position: steps of 3 tokens meet the mistakes in every row
        oracle_drafts_of(monkeypatch, {"r": PROMPT + expected}, wrong_every=4)
    runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=BLOCK, num_speculative_tokens=2)
    ours, kept = generate_spec_greedy(runner, PROMPT, NEW, blocks_for(0, 64, BLOCK), chunk=20,
                                      k=2)
    assert ours == expected
    if oracle:
        assert 0 < sum(kept) < 2 * len(kept)  # drafts were kept and rejected

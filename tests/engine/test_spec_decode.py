"""MTP speculative decoding in the engine: the MTP module's forward against the paper's
equations (with HF transformers' decoder layer as the block), greedy speculative decoding
against HF ``generate`` (which runs no MTP), and speculative sampling's distribution against
plain sampling (chi-square)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3ForCausalLM

from engine.forward_context import build_attention_metadata
from engine.runner import ModelRunner, SeqStep
from engine.sampling_params import SamplingParams
from engine.spec_decode import target_probs, verify
from orchestrator.tiny_model import write_tiny_checkpoint
from tests.engine.engine_drive import blocks_for, generate_greedy
from tests.engine.spec_drive import generate_spec_greedy

BLOCK = 16


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mtp"), seed=4, mtp_layers=1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _hf_block_output(ckpt, x: torch.Tensor, n_layers: int,
                     hf_class: type = DeepseekV3ForCausalLM, **config) -> torch.Tensor:
    """HF's decoder layer ``n_layers`` (the MTP block's weights) of ``hf_class`` (``config``:
    more overrides) over ``x [T, H]`` at positions 0..T-1, causal: the model runs with its
    input replaced there."""
    hf = hf_class.from_pretrained(ckpt, dtype=torch.float32, num_hidden_layers=n_layers + 1,
                                  **config).eval()
    block, seen = hf.model.layers[n_layers], {}

    def swap_input(_mod, args, kwargs):
        if args:
            return (x[None], *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x[None]}

    def keep_output(_mod, _args, _kwargs, out):
        seen["g"] = out[0] if isinstance(out, tuple) else out

    block.register_forward_pre_hook(swap_input, with_kwargs=True)
    block.register_forward_hook(keep_output, with_kwargs=True)
    with torch.no_grad():
        hf(torch.zeros(1, x.shape[0], dtype=torch.long), use_cache=False)
    return seen["g"][0]


def test_mtp_forward_matches_paper_equations(mtp_ckpt):
    """logits_i = lm_head(norm(Block(eh_proj([enorm(Emb t_{i+1}); hnorm(h_i)])))), h_i the
    main model's normed last hidden state (HF's ``last_hidden_state``)."""
    runner = ModelRunner(mtp_ckpt, num_kv_blocks=8, block_size=BLOCK, num_speculative_tokens=1)
    n = runner.model_config.num_hidden_layers
    prompt = torch.randint(0, 129280, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    w = load_file(str(mtp_ckpt / "model.safetensors"))
    main = DeepseekV3ForCausalLM.from_pretrained(mtp_ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        h = main.model(torch.tensor([prompt])).last_hidden_state[0]  # [T, H]
    p = f"model.layers.{n}."
    e = w["model.embed_tokens.weight"][prompt[1:]]  # Emb(t_{i+1}), i = 0..T-2
    x = torch.cat([_rms(e, w[p + "enorm.weight"]), _rms(h[:-1], w[p + "hnorm.weight"])], -1) \
        @ w[p + "eh_proj.weight"].T
    g_ref = _hf_block_output(mtp_ckpt, x, n)
    ref = _rms(g_ref, w[p + "shared_head.norm.weight"]) @ w["lm_head.weight"].T  # [T-1, V]

    with torch.inference_mode():
        table = blocks_for(0, len(prompt), BLOCK)
        ids, meta = runner._inputs([SeqStep("p", tuple(prompt), 0, table)])
        hidden = runner.model(ids, meta, runner.kv_cache, return_hidden=True)
        assert (hidden - h).abs().max() < 1e-4
        mmeta = build_attention_metadata([len(prompt) - 1], [0], [table], BLOCK)
        emb = runner.model.model.embed_tokens(torch.tensor(prompt[1:]))
        cos, sin = runner.model.rotary.cos_sin(mmeta.positions, emb.dtype)
        g = runner.model.mtp.forward_mtp(emb, hidden[:-1], cos, sin, mmeta,
                                         runner.kv_cache.layer_buffers(n))
        ours = runner.model.compute_logits(runner.model.mtp.shared_head.norm(g))
    assert (ours - ref).abs().max() < 1e-4


def test_spec_greedy_matches_hf_generate(mtp_ckpt):
    hf = DeepseekV3ForCausalLM.from_pretrained(mtp_ckpt, dtype=torch.float32).eval()
    prompt = torch.randint(0, 129280, (19,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False, pad_token_id=0)[0, 19:].tolist()
    for k in (1, 2):
        runner = ModelRunner(mtp_ckpt, num_kv_blocks=8, block_size=BLOCK,
                             num_speculative_tokens=k)
        ours, _ = generate_spec_greedy(runner, prompt, 24, blocks_for(0, 19 + 24 + k, BLOCK),
                                       chunk=8, k=k)
        assert ours == ref


# chi-square critical values at p = 0.001 by degrees of freedom
_CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    keep = expected > 5  # NOTE: pool the rare cells into one
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=1.3, top_k=5, top_p=0.95)])
def test_speculative_sampling_matches_plain_sampling(params):
    """Two drafts over a 6-token vocabulary: the first token's distribution is p_0 and the
    second's, given a kept first draft, p_1 (plain sampling's)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=gen)
    drafts = (2, 4)  # NOTE: not the most likely tokens: many rejections
    p = [target_probs(logits[i], params) for i in range(3)]
    n = 8000
    first, second = torch.zeros(6), torch.zeros(6)
    for seed in range(n):
        sp = SamplingParams(temperature=params.temperature, top_k=params.top_k,
                            top_p=params.top_p, seed=seed)
        toks = verify(logits, drafts, sp, step=0)
        assert 1 <= len(toks) <= 3 and list(toks[:-1]) == list(drafts[:len(toks) - 1])
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
    stat, df = _chi2(first, p[0])
    assert stat < _CHI2_999[df], (stat, df, first, p[0])
    stat, df = _chi2(second, p[1])
    assert stat < _CHI2_999[df], (stat, df, second, p[1])


def test_greedy_verify_keeps_longest_matching_prefix():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate((3, 1, 6, 2)):
        logits[row, best] = 5.0
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, (3, 1, 6), greedy, 0) == [3, 1, 6, 2]
    assert verify(logits, (3, 0, 6), greedy, 0) == [3, 1]
    assert verify(logits, (7, 1, 6), greedy, 0) == [3]
    assert verify(logits[:1], (), greedy, 0) == [3]


@pytest.mark.parametrize("scheme", ["w8a8", "fp8-block"])
def test_quantized_mtp_checkpoint_spec_greedy_equals_plain(mtp_ckpt, tmp_path, scheme):
    """`orch model quantize` quantizes the MTP module's linears like the others' and the
    speculative runner loads them (W8A8: int8 modules; FP8: dequantized at load)."""
    from engine.quant.writer import quantize_checkpoint  # noqa: PLC0415 (this test only)

    dst = quantize_checkpoint(mtp_ckpt, tmp_path / scheme, scheme)
    prompt = list(range(500, 517))
    plain = ModelRunner(dst, num_kv_blocks=8, block_size=BLOCK)
    ref, _ = generate_greedy(plain, prompt, 12, blocks_for(0, 30, BLOCK), chunk=8)
    spec = ModelRunner(dst, num_kv_blocks=8, block_size=BLOCK, num_speculative_tokens=1)
    n = spec.model_config.num_hidden_layers
    assert spec.model.mtp is not None and n + 1 == len(spec.model.model.layers)
    ours, _ = generate_spec_greedy(spec, prompt, 12, blocks_for(0, 31, BLOCK), chunk=8, k=1)
    assert ours == ref


def test_a_step_without_drafts_still_caches_its_mtp_rows(mtp_ckpt):
    """A decoding step with a draft input but no draft to make (``num_drafts`` 0: the step's
    token budget ran out) still runs the MTP module over those rows: its MTP cache equals a
    drafting step's, so the next draft reads no hole."""
    from engine.spec_decode import DraftInput  # noqa: PLC0415 (this test only)

    prompt, table = list(range(300, 311)), blocks_for(0, 32, BLOCK)
    caches = []
    for drafts in (0, 1):
        runner = ModelRunner(mtp_ckpt, num_kv_blocks=8, block_size=BLOCK,
                             num_speculative_tokens=1)
        n = runner.model_config.num_hidden_layers
        out = runner.execute([SeqStep("r", tuple(prompt), 0, table)])
        token = int(out.logits[-1].argmax())
        draft = DraftInput(out.hidden[0][-1:], len(prompt) - 1, (token,))
        out = runner.execute([SeqStep("r", (token,), len(prompt), table, draft=draft,
                                      num_drafts=drafts)])
        assert len(out.drafts[0]) == drafts
        k_cache = runner.kv_cache.layer_buffers(n)[0]
        caches.append(k_cache.view(-1, k_cache.shape[-1])[:len(prompt)].clone())
    assert bool(caches[0][-1].any()) and torch.equal(caches[0], caches[1])


def test_a_decoding_chunk_out_of_draft_budget_keeps_its_draft_input():
    """The scheduler hands a decoding chunk whose drafts did not fit the token budget its
    draft input all the same (the MTP module caches those rows), but no stale one."""
    from engine.block_pool import BlockPool  # noqa: PLC0415 (this test only)
    from engine.request import Request, RequestSpec  # noqa: PLC0415
    from engine.scheduler import COLOCATED, Scheduler  # noqa: PLC0415
    from engine.spec_decode import DraftInput  # noqa: PLC0415

    s = Scheduler(BlockPool(64, 4), COLOCATED, chunk_size=8, max_num_batched_tokens=4,
                  max_num_seqs=2, num_speculative_tokens=2)
    reqs = [Request(RequestSpec(r, (100,), SamplingParams(max_tokens=8))) for r in "ab"]
    for req in reqs:
        s.add(req)
    out = s.schedule()
    s.update(out, {"a": 7, "b": 7})
    for req in reqs:
        req.draft = DraftInput(torch.zeros(1, 4), 0, (7,))
    a, b = s.schedule().steps
    assert (a.num_drafts, b.num_drafts) == (2, 0)  # NOTE: 1 + 2 drafts + 1 = the budget
    assert a.draft is reqs[0].draft and b.draft is reqs[1].draft
    reqs[1].draft = DraftInput(torch.zeros(1, 4), 5, (7,))  # not this position's
    assert s.schedule().steps[1].draft is None

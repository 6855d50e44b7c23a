"""Model configuration of a DeepSeek-V2/V3/V3.2 or GLM-5 checkpoint, parsed from its HF
``config.json``.

Accepts both transformers 4.x configs (``rope_scaling`` dict + top-level ``rope_theta``) and
5.x configs (``rope_parameters`` with ``rope_type`` and ``rope_theta``). Field meanings follow
DeepSeek's released ``config.json`` (see /work/shared/REFERENCE.md "Config"); GLM-5's
(``GlmMoeDsaForCausalLM``) follow transformers' ``GlmMoeDsaConfig``: V3.2's DSA with the
indexer's rope interleaved and, from GLM-5.2, "shared" layers (``indexer_types``, else derived
from ``index_topk_pattern`` or ``index_topk_freq`` / ``index_skip_topk_offset``) that run no
indexer and reuse the previous full layer's top-k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.quant.formats import QuantScheme, parse_quantization_config

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM",
                           "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
GLM_DSA_ARCHITECTURE = "GlmMoeDsaForCausalLM"
INDEXER_KINDS = ("full", "shared")
# NOTE: transformers builds the model from model_type, orch from architectures: a config where
# they disagree (a V3.2 model_type under a V3 architecture) would silently run dense attention.
ARCHITECTURE_OF_MODEL_TYPE = {"deepseek_v2": "DeepseekV2ForCausalLM",
                              "deepseek_v3": "DeepseekV3ForCausalLM",
                              "deepseek_v32": "DeepseekV32ForCausalLM",
                              "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
SUPPORTED_SCORING = ("sigmoid", "softmax")
SUPPORTED_TOPK_METHODS = ("noaux_tc", "group_limited_greedy", "greedy")
SUPPORTED_ROPE_TYPES = ("default", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint's config.json names something this runtime cannot run."""


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, has the wrong shape, or is in an unsupported format."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (Peng et al. 2023, "YaRN"), DeepSeek flavour.

    Attributes:
        factor: context extension factor s (40 for V3).
        original_max_position_embeddings: pretraining context, tokens (4096 for V3).
        beta_fast, beta_slow: rotations bounding the interpolation ramp (32, 1).
        mscale, mscale_all_dim: attention temperature coefficients (1.0, 1.0 for V3).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a DeepSeek-V2/V3/V3.2 or GLM-5 model (what the runtime needs, nothing
    more).

    ``q_lora_rank`` None means a plain ``q_proj`` (V2-Lite). ``rope_scaling`` None means plain
    rope with ``rope_theta``. ``eos_token_ids`` is a tuple (config may give an int or a list).
    ``index_n_heads``, ``index_head_dim``, ``index_topk``: DeepSeek-V3.2's lightning indexer
    (64, 128, 2048 in the release); all 0 for V2/V3 (no indexer).
    ``indexer_rope``: the indexer's rope form, "half" (V3.2: non-interleaved) or "interleaved"
    (GLM-5). ``indexer_types``: per layer "full" (own indexer and ``index_k`` cache) or
    "shared" (no indexer, reuses the top-k of the last full layer before it); empty without
    an indexer.
    ``quantization`` None means float weights (else :mod:`engine.quant.formats`).
    ``num_nextn_predict_layers``: MTP modules the checkpoint ships (1 for V3; weights under
    ``model.layers.{num_hidden_layers}.*``, :class:`engine.model.MTPLayer`).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring_func: str
    topk_method: str
    first_k_dense_replace: int
    moe_layer_freq: int
    intermediate_size: int
    moe_intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: YarnScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    indexer_rope: str = "half"
    indexer_types: tuple[str, ...] = ()
    quantization: QuantScheme | None = None
    num_nextn_predict_layers: int = 0

    @property
    def uses_sparse_attention(self) -> bool:
        """True for DSA (V3.2, GLM-5): every layer attends to its top-k tokens only."""
        return self.index_topk > 0

    def has_indexer(self, layer_idx: int) -> bool:
        """True when layer ``layer_idx`` runs its own indexer (and has an ``index_k`` cache).
        The MTP layer (``layer_idx >= num_hidden_layers``) of a DSA checkpoint always has one
        (its weights ship ``self_attn.indexer.*``; vLLM's V3.2 / GLM-5 MTP block keeps it)."""
        if layer_idx >= self.num_hidden_layers:
            return self.uses_sparse_attention
        return self.uses_sparse_attention and self.indexer_types[layer_idx] == "full"

    @property
    def indexer_layers(self) -> tuple[bool, ...]:
        """:meth:`has_indexer` of every layer (all False without DSA)."""
        return tuple(self.has_indexer(i) for i in range(self.num_hidden_layers))

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width of the MHA form: nope + rope (192 for V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, layer_idx: int) -> bool:
        """True when decoder layer ``layer_idx`` has a routed-expert MLP (vLLM/SGLang rule)."""
        return bool(self.n_routed_experts) and layer_idx >= self.first_k_dense_replace \
            and layer_idx % self.moe_layer_freq == 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from the parsed ``config.json``.

        Raises:
            UnsupportedModelError: architecture, scoring_func, topk_method or rope type not
                supported; the message names the field and the allowed values.
            UnsupportedQuantizationError: a ``quantization_config`` other than DeepSeek FP8
                block or compressed-tensors int8 W8A8 (the message names both).
            KeyError: a required field is missing (its name is the key).
        """
        arch = (raw.get("architectures") or [None])[0]
        _check_choice(raw, "architectures", arch, SUPPORTED_ARCHITECTURES)
        _check_model_type(raw.get("model_type"), arch)
        is_v3 = arch != "DeepseekV2ForCausalLM"
        scoring = _check_choice(raw, "scoring_func",
                                raw.get("scoring_func", "sigmoid" if is_v3 else "softmax"),
                                SUPPORTED_SCORING)
        topk_method = _check_choice(raw, "topk_method",
                                    raw.get("topk_method", "noaux_tc" if is_v3 else "greedy"),
                                    SUPPORTED_TOPK_METHODS)
        rope_theta, rope_scaling = _parse_rope(raw)
        eos = raw.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        _check_mlp_layer_types(raw)
        return cls(
            hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            n_routed_experts=raw.get("n_routed_experts"),
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", arch == GLM_DSA_ARCHITECTURE)),
            scoring_func=scoring,
            topk_method=topk_method,
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(raw.get("moe_layer_freq") or 1),
            intermediate_size=int(raw["intermediate_size"]),
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw["max_position_embeddings"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            **_parse_indexer(raw, arch),
            quantization=parse_quantization_config(raw.get("quantization_config")),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
        )


def load_model_config(checkpoint_dir: str | Path) -> ModelConfig:
    """Read ``checkpoint_dir/config.json`` into a :class:`ModelConfig`.

    Raises:
        FileNotFoundError: no config.json in the directory.
        UnsupportedModelError: see :meth:`ModelConfig.from_dict`.
    """
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point the runtime at a HF checkpoint "
                                "directory (config.json + *.safetensors)")
    return ModelConfig.from_dict(json.loads(path.read_text()))


def _check_choice(raw: dict[str, Any], field: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise UnsupportedModelError(
            f"config.json field {field!r} is {value!r}; supported values: {list(allowed)}"
            + (f" (model_type {raw.get('model_type')!r})" if field == "architectures" else ""))
    return value


def _check_model_type(model_type: Any, arch: str) -> None:
    """Refuse a DeepSeek ``model_type`` naming another architecture than ``architectures``
    (other model types, e.g. Kimi-K2's ``kimi_k2`` on DeepseekV3ForCausalLM, pass)."""
    want = ARCHITECTURE_OF_MODEL_TYPE.get(model_type)
    if want is not None and want != arch:
        raise UnsupportedModelError(
            f"config.json is inconsistent: architectures {arch!r} but model_type "
            f"{model_type!r} (transformers builds {want} from it); set both to the same model "
            f"(DeepSeek-V3.2: DeepseekV32ForCausalLM / deepseek_v32)")


def _parse_rope(raw: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) from a 4.x or 5.x config."""
    params = raw.get("rope_parameters")
    if params is not None:  # transformers 5.x
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        scaling = params
    else:  # transformers 4.x
        theta = float(raw.get("rope_theta", 10000.0))
        scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    field = "rope_parameters.rope_type" if params is not None else "rope_scaling.type"
    _check_choice(raw, field, rope_type, SUPPORTED_ROPE_TYPES)
    if rope_type == "default":
        return theta, None
    factor = scaling.get("factor")
    original = int(scaling.get("original_max_position_embeddings")
                   or raw["max_position_embeddings"])
    if factor is None:  # HF rule: the ratio of the extended to the original context
        factor = raw["max_position_embeddings"] / original
    return theta, YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=_float_or(scaling.get("mscale"), 1.0),
        mscale_all_dim=_float_or(scaling.get("mscale_all_dim"), 0.0),
    )


def _parse_indexer(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The DSA indexer fields (none for architectures without an indexer).

    Raises:
        UnsupportedModelError: DSA without ``q_lora_rank`` (the indexer reads the q latent),
            an indexer narrower than ``qk_rope_head_dim`` (its rope dims), or bad
            ``indexer_types`` (:func:`_indexer_types`).
    """
    if arch not in DSA_ARCHITECTURES:
        return {}
    glm = arch == GLM_DSA_ARCHITECTURE
    fields = {"index_n_heads": int(raw.get("index_n_heads", 32 if glm else 64)),
              "index_head_dim": int(raw.get("index_head_dim", 128)),
              "index_topk": int(raw.get("index_topk", 2048))}
    if not raw.get("q_lora_rank"):
        raise UnsupportedModelError(f"{arch} needs q_lora_rank: the lightning indexer's wq_b "
                                    "reads the q latent; set q_lora_rank in config.json")
    if fields["index_head_dim"] < int(raw["qk_rope_head_dim"]) or min(fields.values()) <= 0:
        raise UnsupportedModelError(
            f"config.json indexer {fields} is invalid: all must be positive and index_head_dim "
            f">= qk_rope_head_dim ({raw['qk_rope_head_dim']}), the indexer's rope dims")
    layers = int(raw["num_hidden_layers"])
    kinds = _indexer_types(raw, layers) if glm else ("full",) * layers
    return {**fields, "indexer_rope": "interleaved" if glm else "half", "indexer_types": kinds}


def _indexer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    """GLM-5's per-layer indexer kinds, as transformers' ``GlmMoeDsaConfig``: ``indexer_types``,
    else ``index_topk_pattern`` ("F"/"S" per layer), else layer i is full iff
    ``max(i - offset + 1, 0) % freq == 0`` (``index_topk_freq`` 1, ``index_skip_topk_offset``
    2 by default: every layer full).

    Raises:
        UnsupportedModelError: a kind other than full/shared, a length other than
            ``num_hidden_layers``, or layer 0 shared (no earlier selection to reuse).
    """
    kinds = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        kinds = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] \
            if isinstance(pattern, str) else list(pattern)
    if kinds is None:
        freq = max(int(raw.get("index_topk_freq", 1)), 1)
        offset = int(raw.get("index_skip_topk_offset", 2))
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                 for i in range(layers)]
    kinds = tuple(kinds)
    if len(kinds) != layers or not set(kinds) <= set(INDEXER_KINDS) or kinds[0] != "full":
        raise UnsupportedModelError(
            f"config.json indexer_types {list(kinds)} is invalid: give one of "
            f"{list(INDEXER_KINDS)} per layer ({layers}), the first 'full' (a shared layer "
            "reuses an earlier selection)")
    return kinds


def _check_mlp_layer_types(raw: dict[str, Any]) -> None:
    """Refuse a GLM-5 ``mlp_layer_types`` other than the first_k_dense_replace rule (dense
    layers first, then sparse, :meth:`ModelConfig.is_moe_layer`)."""
    types = raw.get("mlp_layer_types")
    if types is None:
        return
    n, dense = int(raw["num_hidden_layers"]), int(raw.get("first_k_dense_replace") or 0)
    want = ["dense"] * min(dense, n) + ["sparse"] * max(n - dense, 0)
    if list(types) != want or int(raw.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedModelError(
            f"config.json mlp_layer_types {list(types)} is not supported: orch runs the first "
            f"first_k_dense_replace ({dense}) layers dense and the rest MoE; set mlp_layer_types "
            "to that pattern (or drop it)")


def _float_or(value: Any, default: float) -> float:
    return default if value is None else float(value)

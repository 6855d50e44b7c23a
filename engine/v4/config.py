"""DeepSeek-V4 config: the fields of config.json as transformers' ``DeepseekV4Config`` reads them.

Legacy names folded in as transformers does (``configuration_deepseek_v4.py``
``__post_init__``): ``compress_ratios`` (per-layer 0 / 4 / 128) -> ``layer_types``;
``compress_rate_csa`` / ``compress_rate_hca`` -> ``compress_rates``; ``num_hash_layers`` ->
``mlp_layer_types``; ``qk_rope_head_dim`` -> ``partial_rotary_factor``; ``rope_scaling`` (flat
YaRN dict) -> the ``compress`` rope. Per-layer lists longer than ``num_hidden_layers`` (the
MTP layer's entry) are cut to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import CheckpointError, YarnScaling
from engine.rotary import yarn_get_mscale

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
LAYER_TYPES = (SLIDING, CSA, HCA)
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
HASH_MOE, MOE = "hash_moe", "moe"


@dataclass(frozen=True)
class V4Rope:
    """One rope of V4 (``main``: sliding layers; ``compress``: CSA / HCA layers, their
    compressors and the indexer). ``rope_dim`` trailing dims of a head, interleaved pairs.

    Attributes:
        theta: base. yarn: YaRN scaling or None. attention_factor: cos/sin multiplier.
    """

    theta: float
    yarn: YarnScaling | None
    attention_factor: float = 1.0


@dataclass(frozen=True)
class V4Config:
    """DeepSeek-V4 model hyperparameters (names as in transformers' ``DeepseekV4Config``).

    Shapes: ``head_dim`` is the single shared K=V head (512 in V4-Flash), its last
    ``qk_rope_head_dim`` dims carry rope; ``compress_rates[kind]`` tokens make one compressed
    entry; ``layer_types[i]`` / ``mlp_layer_types[i]`` pick layer i's attention and router.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    main_rope: V4Rope
    compress_rope: V4Rope
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_nextn_predict_layers: int
    max_position_embeddings: int

    def is_moe_layer(self, layer: int) -> bool:
        """True for every layer (the MTP layer's too): all route their tokens to experts, by
        ``tid2eid`` on ``hash_moe`` layers, by top-k on ``moe`` ones (``ModelConfig``'s name
        and meaning, so the planner's MoE terms read both)."""
        return 0 <= layer < self.num_hidden_layers + self.num_nextn_predict_layers

    def compress_ratio(self, layer: int) -> int:
        """Tokens per compressed entry of ``layer`` (0: sliding window only)."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else dict(self.compress_rates)[kind]

    @classmethod
    def from_dict(cls, raw: dict) -> V4Config:
        """Parse a config.json dict.

        Raises:
            CheckpointError: not a V4 config, an unknown layer type or legacy ratio, lists
                shorter than ``num_hidden_layers``, an activation other than silu, a scoring
                function other than sqrtsoftplus / sigmoid / softmax.
        """
        if raw.get("model_type") != "deepseek_v4":
            raise CheckpointError(f"model_type {raw.get('model_type')!r} is not deepseek_v4")
        n = raw.get("num_hidden_layers", 43)
        rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
        rates[CSA] = raw.get("compress_rate_csa", rates[CSA])
        rates[HCA] = raw.get("compress_rate_hca", rates[HCA])
        head_dim = raw.get("head_dim", 512)
        rope_dim = raw.get("qk_rope_head_dim")
        if rope_dim is None:
            rope_dim = int(head_dim * (raw.get("partial_rotary_factor") or 64 / 512))
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {raw['hidden_act']!r}: V4 here supports silu")
        if raw.get("scoring_func", "sqrtsoftplus") not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise CheckpointError(f"scoring_func {raw['scoring_func']!r} is not supported")
        main_rope, compress_rope = _ropes(raw)
        return cls(
            vocab_size=raw.get("vocab_size", 129280), hidden_size=raw.get("hidden_size", 4096),
            num_hidden_layers=n, num_attention_heads=raw.get("num_attention_heads", 64),
            head_dim=head_dim, qk_rope_head_dim=rope_dim, q_lora_rank=raw.get("q_lora_rank", 1024),
            o_groups=raw.get("o_groups", 8), o_lora_rank=raw.get("o_lora_rank", 1024),
            sliding_window=raw.get("sliding_window", 128), layer_types=_layer_types(raw, n),
            compress_rates=tuple(sorted(rates.items())),
            index_n_heads=raw.get("index_n_heads", 64),
            index_head_dim=raw.get("index_head_dim", 128), index_topk=raw.get("index_topk", 512),
            hc_mult=raw.get("hc_mult", 4), hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
            hc_eps=raw.get("hc_eps", 1e-6), mlp_layer_types=_mlp_layer_types(raw, n),
            n_routed_experts=raw.get("n_routed_experts", 256),
            num_experts_per_tok=raw.get("num_experts_per_tok", 6),
            n_shared_experts=raw.get("n_shared_experts", 1),
            moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
            scoring_func=raw.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.5),
            swiglu_limit=raw.get("swiglu_limit", 10.0), main_rope=main_rope,
            compress_rope=compress_rope, rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            num_nextn_predict_layers=raw.get("num_nextn_predict_layers", 1),
            max_position_embeddings=raw.get("max_position_embeddings", 1048576))


def _layer_types(raw: dict, n: int) -> tuple[str, ...]:
    """``layer_types``, else legacy ``compress_ratios``, else V4-Pro's default (2 HCA, then
    HCA / CSA alternating)."""
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        unknown = set(raw["compress_ratios"]) - set(_LEGACY_RATIO_TO_TYPE)
        if unknown:
            raise CheckpointError(f"compress_ratios has {sorted(unknown)}; transformers maps "
                                  "only 0 / 4 / 128: write layer_types instead")
        types = [_LEGACY_RATIO_TO_TYPE[r] for r in raw["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) < n:
        raise CheckpointError(f"layer_types must list {n} of {LAYER_TYPES}; got {types}")
    return tuple(types[:n])


def _mlp_layer_types(raw: dict, n: int) -> tuple[str, ...]:
    """``mlp_layer_types``, else ``num_hash_layers`` (default 3) hash_moe then moe."""
    types = raw.get("mlp_layer_types")
    if types is None:
        n_hash = raw.get("num_hash_layers", 3)
        types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    if set(types) - {HASH_MOE, MOE} or len(types) < n:
        raise CheckpointError(f"mlp_layer_types must list {n} of hash_moe / moe; got {types}")
    return tuple(types[:n])


def _ropes(raw: dict) -> tuple[V4Rope, V4Rope]:
    """(main, compress) ropes: main plain at ``rope_theta``; compress at
    ``compress_rope_theta`` with the YaRN of ``rope_scaling`` / flat ``rope_parameters``
    (cos/sin unscaled: transformers forces ``attention_factor`` 1.0 there), or the nested
    ``rope_parameters`` {"main", "compress"} as written."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        # NOTE: as written, a YaRN without attention_factor gets transformers' mscale ratio
        return _rope(params["main"], None, None), _rope(params["compress"], None, None)
    flat = {**(raw.get("rope_scaling") or {}), **params}
    main = V4Rope(theta=float(flat.get("rope_theta", raw.get("rope_theta", 10000.0))),
                  yarn=None)
    compress = _rope(flat, float(raw.get("compress_rope_theta", 160000.0)), 1.0)
    return main, compress


def _rope(params: dict, theta: float | None, attention_factor: float | None) -> V4Rope:
    """One rope; ``theta`` overrides the dict's, ``attention_factor`` None: the dict's, else
    transformers' ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` (or
    ``mscale(factor)`` without both)."""
    kind = params.get("rope_type", params.get("type", "default"))
    base = theta if theta is not None else float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return V4Rope(theta=base, yarn=None)
    if kind != "yarn":
        raise CheckpointError(f"rope_type {kind!r}: V4 here supports default and yarn")
    yarn = YarnScaling(factor=float(params["factor"]),
                       original_max_position_embeddings=int(
                           params["original_max_position_embeddings"]),
                       beta_fast=float(params.get("beta_fast") or 32),
                       beta_slow=float(params.get("beta_slow") or 1),
                       mscale=float(params.get("mscale") or 1.0),
                       mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
    if params.get("attention_factor") is not None:
        attention_factor = float(params["attention_factor"])
    elif attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_get_mscale(yarn.factor, m) / yarn_get_mscale(yarn.factor, m_all)
                            if m and m_all else yarn_get_mscale(yarn.factor))
    return V4Rope(theta=base, yarn=yarn, attention_factor=attention_factor)

"""The TP layout table: one rule per parameter, shard shapes, the one divisibility check."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
import torch

from engine.kernels import KERNELS
from engine.layout import RULES, SPLIT_UNITS, Split, TPLayout, rule_for, tp_layout
from engine.model import build_model
from engine.model_config import ModelConfig
from engine.parallel import TPGroup
from orchestrator.tiny_model import tiny_config_dict

# Between them: q_a/q_b and plain q_proj, dense and MoE layers, V3 router bias and V2
# (softmax, no bias, 2 shared experts), V3.2's replicated lightning indexer, V3's MTP module.
CONFIGS = {
    "v3": tiny_config_dict(),
    "v3_mtp": tiny_config_dict(mtp_layers=1),
    "no_q_lora": tiny_config_dict(q_lora_rank=None, yarn=False),
    "v2": tiny_config_dict(deepseek_v2=True),
    "v32": tiny_config_dict(deepseek_v32=True),
}


def _params(raw: dict, tp: TPGroup) -> dict[str, tuple[int, ...]]:
    """Parameter name -> local shape of rank ``tp.rank``, built on the meta device."""
    cfg = ModelConfig.from_dict(raw)
    model = build_model(cfg, tp, KERNELS.resolve("cpu"), torch.float32, torch.device("meta"),
                        mtp=cfg.num_nextn_predict_layers > 0 and not cfg.uses_sparse_attention)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def test_every_parameter_matches_exactly_one_rule_and_every_rule_is_used():
    used = set()
    for raw in CONFIGS.values():
        for name in _params(raw, TPGroup()):
            matches = [r for r in RULES if re.fullmatch(r.pattern, name)]
            assert len(matches) == 1, f"{name}: {[r.pattern for r in matches]}"
            assert rule_for(name) is matches[0]
            used.add(matches[0])
    assert used == set(RULES), [r.pattern for r in RULES if r not in used]


def test_row_and_column_rules_and_only_they_name_a_unit_and_every_unit_has_a_local_size():
    assert all((r.unit is None) == (r.split in (Split.REPLICATED, Split.VOCAB)) for r in RULES)
    assert set(SPLIT_UNITS) <= {f.name for f in fields(TPLayout)}


def test_a_parameter_without_a_rule_is_refused_by_name():
    with pytest.raises(LookupError, match=r"model\.layers\.0\.self_attn\.w_new\.weight "
                                          r"matches 0 rules"):
        rule_for("model.layers.0.self_attn.w_new.weight")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_tp2_shard_shapes(config):
    raw = CONFIGS[config]
    full = _params(raw, TPGroup())
    layout = tp_layout(ModelConfig.from_dict(raw), 2)
    for rank in (0, 1):
        local = _params(raw, TPGroup(rank=rank, size=2))
        assert local.keys() == full.keys()
        for name, shape in full.items():
            dim = rule_for(name).split.dim
            want = shape if dim is None else tuple(
                -(-n // 2) if d == dim else n for d, n in enumerate(shape))
            assert local[name] == want, name
            assert rule_for(name).full_shape(local[name], layout) == shape, name
            assert rule_for(name).local_shape(shape, layout) == local[name], name


def test_tp2_shard_shapes_by_name():
    """Spelled out for the default tiny config: 4 heads of q 48 / nope 32 / rope 16 / v 32,
    hidden 64, dense intermediate 128, experts 32 (1 shared), vocab 129280."""
    local = _params(CONFIGS["v3"], TPGroup(rank=1, size=2))
    att, mlp = "model.layers.0.self_attn.", "model.layers.1.mlp."
    assert local[att + "q_a_proj.weight"] == (48, 64)
    assert local[att + "q_b_proj.weight"] == (2 * 48, 48)  # 2 heads x (32 + 16)
    assert local[att + "kv_a_proj_with_mqa.weight"] == (32 + 16, 64)
    assert local[att + "kv_b_proj.weight"] == (2 * 64, 32)  # 2 heads x (32 + 32)
    assert local[att + "o_proj.weight"] == (64, 2 * 32)
    assert local["model.layers.0.mlp.up_proj.weight"] == (64, 64)
    assert local["model.layers.0.mlp.down_proj.weight"] == (64, 64)
    assert local[mlp + "experts.7.gate_proj.weight"] == (16, 64)
    assert local[mlp + "experts.7.down_proj.weight"] == (64, 16)
    assert local[mlp + "shared_experts.up_proj.weight"] == (16, 64)
    assert local[mlp + "gate.weight"] == (8, 64)
    assert local["model.embed_tokens.weight"] == local["lm_head.weight"] == (129280 // 2, 64)


def test_local_slices_take_contiguous_part_rank_of_the_split_dim():
    rows, cols = rule_for("model.layers.0.mlp.up_proj.weight"), rule_for(
        "model.layers.0.mlp.down_proj.weight")
    t = torch.arange(8 * 6).view(8, 6)
    tp2, tp3 = _layout(tp=2), _layout(tp=3)
    assert torch.equal(t[rows.local_slices((8, 6), 1, tp2)], t[4:])
    assert torch.equal(t[cols.local_slices((8, 6), 2, tp3)], t[:, 4:])
    everything = rule_for("model.norm.weight").local_slices((8,), 1, tp2)
    assert torch.equal(torch.arange(8)[everything], torch.arange(8))


def _layout(tp: int) -> TPLayout:
    """A layout of ``tp`` ranks (only tp_size matters to COLUMN / ROW / REPLICATED rules)."""
    return TPLayout(4, 4, 4, 4, 4, range(0), tp_size=tp, ep_size=1, full_vocab_size=4)


def test_local_shape_of_an_expert_weight_is_whole_under_ep_and_split_without():
    """What the memory plan counts per rank: an expert's down_proj [hidden 64, moe 32]."""
    config = ModelConfig.from_dict(CONFIGS["v3"])
    down = rule_for("model.layers.1.mlp.experts.3.down_proj.weight")
    shared = rule_for("model.layers.1.mlp.shared_experts.down_proj.weight")
    tp2, tp2_ep4 = tp_layout(config, 2), tp_layout(config, 2, ep_size=4)
    assert down.local_shape((64, 32), tp2) == (64, 16)
    assert down.local_shape((64, 32), tp2_ep4) == (64, 32)
    assert shared.local_shape((64, 32), tp2_ep4) == (64, 16)  # shared experts stay TP
    vocab = rule_for("lm_head.weight").local_shape((129283, 64), tp_layout(
        ModelConfig.from_dict({**CONFIGS["v3"], "vocab_size": 129283}), 2))
    assert vocab == (64642, 64)  # ceil(129283 / 2), the last shard padded


def test_local_sizes():
    layout = tp_layout(ModelConfig.from_dict(CONFIGS["v3"]), 2)
    assert (layout.num_attention_heads, layout.intermediate_size,
            layout.moe_intermediate_size) == (2, 64, 16)


def test_tp_that_does_not_divide_heads_says_what_to_change():
    config = ModelConfig.from_dict(CONFIGS["v3"])
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4 .*use a "
                                         r"tp that divides it .*: \[1, 2, 4\]"):
        tp_layout(config, 3)
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        build_model(config, TPGroup(rank=0, size=3), KERNELS.resolve("cpu"), torch.float32,
                    torch.device("meta"))


def test_tp_that_does_not_divide_expert_width_says_what_to_change():
    raw = dict(tiny_config_dict(num_heads=8), moe_intermediate_size=12)
    with pytest.raises(ValueError, match=r"tp=8 does not divide moe_intermediate_size=12 .*"
                                         r": \[1, 2, 4\]"):
        tp_layout(ModelConfig.from_dict(raw), 8)

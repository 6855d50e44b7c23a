"""config.json parsing, YaRN frequencies and the softmax scale."""

from __future__ import annotations

import math

import pytest
import torch

from engine.model_config import ModelConfig, UnsupportedModelError
from engine.rotary import RotaryEmbedding, apply_rotary_interleaved, softmax_scale

V3 = {  # the fields of DeepSeek-V3's released config.json that matter here
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "vocab_size": 129280, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1,
}


def test_v3_config_fields_and_softmax_scale():
    cfg = ModelConfig.from_dict(V3)
    assert cfg.qk_head_dim == 192 and cfg.q_lora_rank == 1536 and cfg.eos_token_ids == (1,)
    assert cfg.rope_scaling.factor == 40
    assert cfg.rope_scaling.original_max_position_embeddings == 4096
    assert [cfg.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    # REFERENCE.md: 192^-0.5 * 1.873854 = 0.135234
    assert softmax_scale(cfg) == pytest.approx(0.135234, abs=1e-6)
    assert RotaryEmbedding(cfg).cos_sin_mscale == 1.0


def test_transformers5_rope_parameters_equal_4x_rope_scaling():
    v5 = {k: v for k, v in V3.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0,
                             **{k: v for k, v in V3["rope_scaling"].items() if k != "type"}}
    assert ModelConfig.from_dict(v5) == ModelConfig.from_dict(V3)


def test_moe_layer_freq_and_dense_model():
    cfg = ModelConfig.from_dict({**V3, "first_k_dense_replace": 1, "moe_layer_freq": 2})
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, False, True, False, True, False]
    dense = ModelConfig.from_dict({**V3, "n_routed_experts": None})
    assert not any(dense.is_moe_layer(i) for i in range(61))


@pytest.mark.parametrize("field,value", [
    ("architectures", ["LlamaForCausalLM"]), ("scoring_func", "sqrtsoftplus"),
    ("topk_method", "aux_free"), ("rope_scaling", {"type": "longrope", "factor": 2.0})])
def test_unsupported_values_name_the_field(field, value):
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dict({**V3, field: value})
    assert field.split("_")[0] in str(err.value) and "supported values" in str(err.value)


def test_yarn_inv_freq_equals_hf():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = DeepseekV3Config(**{k: v for k, v in V3.items() if k != "architectures"})
    hf_inv, hf_attn_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = RotaryEmbedding(ModelConfig.from_dict(V3))
    torch.testing.assert_close(ours.inv_freq, hf_inv, rtol=1e-6, atol=0)  # fp32 ulps
    assert ours.cos_sin_mscale == pytest.approx(hf_attn_factor)


def test_interleaved_rotation_is_gptj_pairs():
    """Pair (x[2i], x[2i+1]) rotates by angle pos * inv_freq[i]; the output stays interleaved."""
    cfg = ModelConfig.from_dict({**V3, "rope_scaling": None})
    rot = RotaryEmbedding(cfg)
    x = torch.randn(3, 2, 64, dtype=torch.float64)
    pos = torch.tensor([0, 5, 1000])
    cos, sin = rot.cos_sin(pos, torch.float64)
    y = apply_rotary_interleaved(x, cos, sin)
    ang = pos[1].item() * rot.inv_freq[7].item()
    z = complex(x[1, 1, 14], x[1, 1, 15]) * complex(math.cos(ang), math.sin(ang))
    assert y[1, 1, 14].item() == pytest.approx(z.real, abs=1e-5)
    assert y[1, 1, 15].item() == pytest.approx(z.imag, abs=1e-5)
    torch.testing.assert_close(y[0], x[0])  # position 0: identity
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))  # a rotation

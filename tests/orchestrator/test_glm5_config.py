"""GLM-5's shipped config.json (configs/models/glm-5/) and its A3 layout
(configs/a3_glm5_p2x16_d8x4.yaml): the sizes transformers' GlmMoeDsaConfig describes, 744B
parameters, and a memory plan that fits seed 004's ranks with index_k on every layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import GlmMoeDsaConfig

from engine.model_config import ModelConfig
from orchestrator.cli import main
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import build_memory_plan
from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.config.role_layout import RoleLayout

REPO = Path(__file__).resolve().parents[2]
GLM5 = REPO / "configs" / "models" / "glm-5" / "config.json"
A3_GLM5 = REPO / "configs" / "a3_glm5_p2x16_d8x4.yaml"


def test_config_json_is_transformers_glm5_with_the_issue_sizes():
    raw = json.loads(GLM5.read_text())
    defaults = GlmMoeDsaConfig().to_dict()
    differs = {k for k, v in raw.items() if k in defaults and defaults[k] != v}
    assert differs == {"architectures", "dtype", "rope_parameters"}, differs
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_attention_heads, cfg.hidden_size,
            cfg.num_hidden_layers, cfg.vocab_size, cfg.index_n_heads) == \
        (192, 256, 64, 6144, 78, 154880, 32)
    assert cfg.indexer_rope == "interleaved" and cfg.indexer_layers == (True,) * 78
    w8a8 = json.loads((GLM5.parents[1] / "glm-5-w8a8" / "config.json").read_text())
    assert {k: v for k, v in w8a8.items() if k != "quantization_config"} == raw


def test_glm5_has_744b_parameters():
    layout = RoleLayout("decode", dp=1, tp=1, ep=False, num_kv_blocks=1, block_size=1,
                        step_tokens=1, max_num_seqs=1, max_model_len=1)
    plan = plan_role(ModelConfig.from_dict(json.loads(GLM5.read_text())), layout,
                     Precision.of("bfloat16"))
    params = sum(row.elements for row in plan.rows if row.group == "weights")
    assert params == pytest.approx(744e9, rel=0.002)  # zai-org's figure (MTP layer skipped)


def test_a3_layout_fits_and_dry_run_accepts_it(capsys):
    plan, _ = build_memory_plan(load_config(A3_GLM5))
    prefill, decode = plan.roles
    assert (prefill.layout.cp, prefill.layout.ranks, decode.layout.tp) == (16, 32, 4)
    index_k = [r for r in decode.rows if r.kind == "KV cache: index_k"]
    assert index_k and index_k[0].elements == 78 * 2176 * 128 * 128
    assert main(["up", "--dry-run", str(A3_GLM5)]) == 0
    assert "memory plan: fits npu default: Atlas A3 die" in capsys.readouterr().out

"""The per-rank memory plan (orchestrator/config/memory_plan.py and its rows) on DeepSeek-V3's
real config.json, checked against a hand computation (tests.orchestrator.deepseek_v3.py) and
the parameters the engine builds."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from engine.model_config import ModelConfig
from kv_transfer.backend import COMM_SETTINGS
from orchestrator.config.devices import GB
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import build_memory_plan
from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.config.role_layout import RoleLayout
from tests.e2e.harness import REPO
from tests.orchestrator.deepseek_v3 import (A3, KV_A, KV_B, O, Q_A, Q_B, V3_JSON, VOCAB,
                                             hand_activations, hand_plan, v3)


def test_deepseek_v3_has_671b_parameters():
    layout = RoleLayout("decode", dp=1, tp=1, ep=False, num_kv_blocks=1, block_size=1,
                        step_tokens=1, max_num_seqs=1, max_model_len=1)
    plan = plan_role(v3(), layout, Precision.of("bfloat16"))
    params = sum(row.elements for row in plan.rows if row.group == "weights")
    assert params == pytest.approx(671e9, rel=0.005)  # DeepSeek's figure, without the MTP layer


@pytest.mark.parametrize("arch", ["v3", "no_q_lora", "v2", "v32", "glm5", "glm5_shared"])
@pytest.mark.parametrize("tp, dp, ep", [(1, 1, False), (2, 1, False), (4, 1, False),
                                        (2, 2, True), (1, 4, True)])
def test_weight_rows_count_exactly_what_the_engine_builds(arch, tp, dp, ep):
    """Every parameter the engine builds for one rank (last TP rank, EP rank 0), on the meta
    device: the plan's weight rows hold the same number of elements (with the MTP module, its
    own indexer under DSA, in the tp 2 layouts)."""
    import torch

    from engine.kernels import KERNELS
    from engine.model import build_model
    from engine.parallel import EPGroup, TPGroup
    from orchestrator.tiny_model import tiny_config_dict

    raw = {"v3": tiny_config_dict(), "no_q_lora": tiny_config_dict(q_lora_rank=None),
           "v2": tiny_config_dict(deepseek_v2=True),
           "v32": tiny_config_dict(deepseek_v32=True),
           "glm5": tiny_config_dict(glm_moe_dsa=True),
           "glm5_shared": tiny_config_dict(glm_moe_dsa=True, num_layers=4,
                                           indexer_types=("full", "shared", "full", "shared"))
           }[arch]
    model_config, mtp = ModelConfig.from_dict(raw), tp == 2
    model = build_model(model_config, TPGroup(rank=tp - 1, size=tp), KERNELS.resolve("cpu"),
                        torch.float32, torch.device("meta"),
                        ep=EPGroup(0, dp * tp) if ep else None, mtp=mtp)
    layout = RoleLayout("decode", dp=dp, tp=tp, ep=ep, num_kv_blocks=1, block_size=1,
                        step_tokens=1, max_num_seqs=1, max_model_len=1, mtp=mtp)
    plan = plan_role(model_config, layout, Precision.of("float32"))
    assert sum(r.elements for r in plan.rows if r.group == "weights") == \
        sum(p.numel() for p in model.parameters())
    # the KV rows hold what the engine's cache allocates: index_k on indexer layers only
    from engine.kv_cache import KVCacheSpec

    from engine.kv_layer_spec import mla_layer_specs

    spec = KVCacheSpec.from_layer_specs(mla_layer_specs(model_config, int(mtp)), num_blocks=1,
                                        block_size=1, mtp_layers=int(mtp))
    assert sum(r.elements for r in plan.rows if r.group == "kv") * 4 == spec.bytes_per_token


def test_a_change_in_the_engines_layout_table_changes_the_plan(monkeypatch):
    """The plan reads engine/layout.py's rules: o_proj and the embedding made replicated
    there move exactly those two rows, by the hand-computed amounts."""
    import engine.layout as layout_table

    layout = RoleLayout("decode", dp=1, tp=4, ep=False, num_kv_blocks=1, block_size=1,
                        step_tokens=1, max_num_seqs=1, max_model_len=1)
    before = {r.kind: r.elements for r in plan_role(v3(), layout, Precision.of("bfloat16")).rows}
    replicated = {r"model\.layers\.\d+\.self_attn\.o_proj\.weight",
                  r"model\.embed_tokens\.weight"}
    rules = tuple(replace(rule, split=layout_table.REPLICATED, unit=None)
                  if rule.pattern in replicated else rule for rule in layout_table.RULES)
    monkeypatch.setattr(layout_table, "_COMPILED",
                        tuple((re.compile(rule.pattern), rule) for rule in rules))
    after = {r.kind: r.elements for r in plan_role(v3(), layout, Precision.of("bfloat16")).rows}
    assert after["attention"] - before["attention"] == 61 * (O - O // 4)
    assert (before["embedding"], after["embedding"]) == (VOCAB // 4, VOCAB)
    assert {kind for kind in before if after[kind] != before[kind]} == {"attention",
                                                                        "embedding"}


def test_deepseek_v32_adds_the_indexer_and_its_kv_row():
    raw = {**json.loads(V3_JSON.read_text()), "architectures": ["DeepseekV32ForCausalLM"],
           "model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128,
           "index_topk": 2048}
    layout = RoleLayout("decode", dp=1, tp=4, ep=False, num_kv_blocks=10, block_size=128,
                        step_tokens=1, max_num_seqs=1, max_model_len=1)
    bf16 = Precision.of("bfloat16")
    v32 = {r.kind: r for r in plan_role(ModelConfig.from_dict(raw), layout, bf16).rows}
    v3_ = {r.kind: r for r in plan_role(v3(), layout, bf16).rows}
    assert set(v32) - set(v3_) == {"indexer (V3.2)", "KV cache: index_k"}
    assert v32["indexer (V3.2)"].elements == 61 * (1536 * 64 * 128 + 7168 * (128 + 64))
    assert v32["KV cache: index_k"].elements == 61 * 1280 * 128
    kv = sum(r.bytes for r in v32.values() if r.group == "kv")
    assert kv == 1280 * (512 + 64 + 128) * 2 * 61  # 1,408 B per token per layer


def test_cp_prefill_replicates_attention_and_layer_shards_the_named_weights():
    def rows(**cp):
        layout = RoleLayout("prefill", dp=1, tp=1, ep=False, num_kv_blocks=1, block_size=1,
                            step_tokens=1, max_num_seqs=1, max_model_len=1, **cp)
        return {r.kind: r for r in plan_role(v3(), layout, Precision.of("bfloat16")).rows}

    replicated = rows(cp=4)
    assert replicated["attention"].elements == 61 * (Q_A + KV_A + Q_B + O)  # not divided
    assert "layer-sharding prefetch" not in replicated
    sharded = rows(cp=4, layer_sharding=("q_b_proj", "o_proj", "kv_b_proj"))
    assert sharded["attention"].elements == 61 * (Q_A + KV_A) + 16 * (Q_B + O)  # ceil(61/4)
    assert sharded["attention: kv_b_proj"].elements == 16 * KV_B
    assert sharded["layer-sharding prefetch"].elements == 2 * (Q_B + O + KV_B)
    assert sharded["layer-sharding prefetch"].group == "workspace"
    assert "q_b_proj, o_proj layer-sharded: 16 of 61 layers (cp 4)" in \
        sharded["attention"].split
    from engine.layer_sharding import layer_sharding_bytes  # the engine's own count

    stored, pool = layer_sharding_bytes(v3(), ("q_b_proj", "o_proj", "kv_b_proj"), 4, 0, 1)
    assert stored == 16 * (Q_B + O + KV_B)
    assert pool == sharded["layer-sharding prefetch"].elements


@pytest.mark.parametrize("role, tp, blocks, seqs, step_tokens, prefix", [
    ("prefill", 16, 768, 64, 16384, 69632), ("decode", 4, 1088, 32, 32, 0)])
def test_a3_memory_table_matches_the_hand_computation(role, tp, blocks, seqs, step_tokens,
                                                      prefix):
    plan, _ = build_memory_plan(load_config(A3))
    (mine,) = [p for p in plan.roles if p.layout.role == role]
    hand = hand_plan(tp, experts_per_rank=256 // 32, blocks=blocks, seqs=seqs)
    rows = {row.kind: row.bytes / GB for row in mine.rows}
    for kind in ("attention", "attention: kv_b_proj", "dense MLP", "shared experts",
                 "routed experts", "embedding", "lm_head", "norms + router gate"):
        assert rows[kind] == pytest.approx(hand[kind], rel=0.01), kind
    assert mine.bytes_of("kv") / GB == pytest.approx(hand["kv"], rel=0.01)
    assert rows["workspace: logits"] == pytest.approx(hand["logits"], rel=0.01)
    weights = sum(hand[k] for k in hand if k not in ("kv", "logits"))
    assert mine.bytes_of("weights") / GB == pytest.approx(weights, rel=0.01)
    activations = hand_activations(tp, step_tokens, prefix)
    assert rows["workspace: activations"] == pytest.approx(activations, rel=0.01)
    # HCCL: 8 KV pair groups x 2 x 16 MiB (their own hccl_buffer_size) + TP and EP groups
    # x 2 x HCCL_BUFFSIZE (200 MiB)
    comm = (8 * 2 * 16 + 2 * 2 * 200) * 2**20 / GB
    assert mine.bytes_of("communicators") / GB == pytest.approx(comm, rel=1e-9)
    total = weights + hand["kv"] + hand["logits"] + activations + comm
    assert mine.total_bytes / GB == pytest.approx(total, rel=0.01)
    assert mine.total_bytes < 64 * GB


def _rows(plan, role):
    (mine,) = [p for p in plan.roles if p.layout.role == role]
    return {row.kind: row for row in mine.rows}


@pytest.mark.parametrize("config, role, pairs, collectives", [
    ("a3_p2x16_d8x4.yaml", "prefill", 8, "TP + EP"),  # P16 -> D4: one decode rank each x 8
    ("a3_p2x16_d8x4.yaml", "decode", 8, "TP + EP"),  # 4 prefill ranks each x 2 instances
    ("a3_v32_p2x16_d8x4.yaml", "prefill", 32, "EP + CP"),  # CP16: every rank sends all
    ("gpu_p4x8_d8x4.yaml", "decode", 8, "TP + EP")])
def test_communicator_rows_count_pair_groups_and_collectives(config, role, pairs, collectives):
    plan, _ = build_memory_plan(load_config(REPO / "configs" / config))
    rows = _rows(plan, role)
    settings = COMM_SETTINGS[load_config(REPO / "configs" / config).platform().dist_backend]
    pair_row, coll_row = rows["comm: KV pair groups"], rows["comm: TP/EP/CP groups"]
    assert pair_row.bytes == pairs * settings.pair_buffer_bytes
    assert pair_row.split.startswith(f"{pairs} KV pair group(s)")
    assert coll_row.bytes == len(collectives.split(" + ")) * settings.buffer_bytes
    assert coll_row.split.startswith(collectives)


def test_comm_buffer_mb_overrides_the_collective_buffer_only():
    plan, _ = build_memory_plan(load_config(A3, {"kv_transfer.comm_buffer_mb": 100}))
    rows = _rows(plan, "decode")
    assert rows["comm: TP/EP/CP groups"].bytes == 2 * 100 * 10**6
    assert rows["comm: KV pair groups"].bytes == 8 * COMM_SETTINGS["hccl"].pair_buffer_bytes


def test_gloo_layouts_have_no_communicator_rows():
    plan, _ = build_memory_plan(load_config(REPO / "configs" / "1p1d.yaml"))
    assert all(p.bytes_of("communicators") == 0 for p in plan.roles)
    assert not any(r.group == "communicators" for p in plan.roles for r in p.rows)


W8A8_CONFIG = {"quant_method": "compressed-tensors", "format": "int-quantized",
               "config_groups": {"group_0": {
                   "targets": ["Linear"], "format": "int-quantized",
                   "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                               "strategy": "channel", "dynamic": False},
                   "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                         "strategy": "token", "dynamic": True}}},
               "ignore": ["lm_head"]}


@pytest.mark.parametrize("scheme, storage, linear_bytes", [
    ("fp8", "dequantize", 2), ("fp8", "fp8", 1), ("w8a8", "dequantize", 1)])
def test_a3_weights_of_a_quantized_checkpoint(tmp_path, scheme, storage, linear_bytes):
    """The released FP8 checkpoint (its own quantization_config) and a W8A8 one: linear
    weights at 1 byte (+ the scales, < 0.1 %) unless FP8 is dequantized at load."""
    raw = json.loads(V3_JSON.read_text())
    if scheme == "w8a8":
        raw["quantization_config"] = W8A8_CONFIG
    assert raw["quantization_config"]["quant_method"] in ("fp8", "compressed-tensors")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_config(A3, {"model.config_json": str(tmp_path / "config.json"),
                           "model.fp8_storage": storage})
    plan, _ = build_memory_plan(cfg)
    for mine, tp, blocks, seqs in zip(plan.roles, (16, 4), (768, 1088), (64, 32)):
        hand = hand_plan(tp, 8, blocks, seqs, linear_bytes)
        weights = sum(hand[k] for k in hand if k not in ("kv", "logits"))
        assert mine.bytes_of("weights") / GB == pytest.approx(weights, rel=0.01)

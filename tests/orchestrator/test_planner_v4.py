"""`orch plan` for DeepSeek-V4 (orchestrator/planner/counts_v4.py): the per-step terms that
differ from V3, by hand on the tiny V4 config, and the A3 V4 layout planned end to end."""

from __future__ import annotations

import pytest

from engine.v4.config import V4Config
from orchestrator.config.load import load_config
from orchestrator.config.memory_plan import Precision
from orchestrator.planner import counts_v4
from orchestrator.planner.comm_terms import allreduce_s, kv_transfer_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.terms import counts_for
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.report import plan_config, requests_held
from orchestrator.planner.specs import named_device
from orchestrator.tiny_model_v4 import tiny_v4_config_dict
from tests.e2e.harness import REPO

TINY = V4Config.from_dict(tiny_v4_config_dict())  # 4 heads x 32; window 8; CSA x2, HCA 1/16
BF16 = Precision.of("bfloat16")


def test_decode_attention_flops_by_hand():
    # the query at position 100: 4 x 4 heads x 32 = 512 FLOPs per key; keys: window 8 in each
    # of 4 layers, CSA min(100 / 4, top-3) = 3 in each of 2 layers, HCA 100 / 16 = 6.25; the
    # indexer scores 25 entries x 2 x 8 heads x 16 in each CSA layer.
    got = counts_v4.attention_flops(TINY, 1, 99)
    assert got == pytest.approx(512 * (4 * 8 + 2 * 3 + 6.25) + 2 * 25 * 2 * 8 * 16)


def test_prefill_attention_flops_sum_the_queries():
    one_by_one = sum(counts_v4.attention_flops(TINY, 1, p) for p in range(40))
    assert counts_v4.attention_flops(TINY, 40, 0) == pytest.approx(one_by_one)
    assert counts_v4.mha_keys(TINY, 40, 0) == 0.0  # no MHA form: the device's attn_prefill


def test_decode_kv_read_by_hand():
    # context 100, 2 bytes: window 8 x 32 x 4 layers; CSA top-3 entries x 32 + 25 index
    # keys x 16, 2 layers; HCA 6.25 x 32
    got = counts_v4.kv_read_per_seq(TINY, BF16, 100)
    assert got == pytest.approx(2 * (8 * 32 * 4 + 2 * (3 * 32 + 25 * 16) + 6.25 * 32))


def test_kv_transfer_ships_the_spec_bytes():
    hw = Hardware(named_device("a3"))
    cost = kv_transfer_cost(TINY, BF16, hw, 100, 8)
    want = 2 * 4512 / hw.link(8) + 4 * hw.latency_s  # test_memory_plan_v4's 100-token request
    assert cost.total_s == pytest.approx(want)
    assert counts_for(TINY) is counts_v4


def test_a3_v4_layout_is_planned():
    cfg = load_config(REPO / "configs" / "a3_v4_p2x16_d8x4.yaml", planning=True)
    plan = plan_config(cfg, WorkloadSpec(65536, 3072), named_device("a3"))
    # the V4 group pools (engine/pool_plan.py): decode's hold max_num_seqs 32 requests of
    # 68.6K; prefill's budget (768 blocks a group) 10 prompts of 64K at chunks of 8192
    assert plan.slots == 32
    assert requests_held(plan.prefill, 65536, plan.memory.model) == 10
    shipped = counts_v4.kv_bytes_per_request(plan.memory.model, BF16, 65536)
    assert shipped < 0.1 * 61 * (512 + 64 + 128) * 2 * 65536  # V3.2's at the same length
    assert 0 < plan.step_cost.total_s < plan.prefill_cost.total_s


def test_a3_v4_decode_tp_collectives_two_allreduces_per_layer_under_ep():
    """Under EP V4 still all-reduces twice per layer, as it runs (engine/v4/model.py): after
    the grouped output projection and after the MoE (the TP-split shared expert's partial sum
    plus the routed experts', complete on each TP rank's token slice); + the embedding's, and
    the logits gather."""
    cfg = load_config(REPO / "configs" / "a3_v4_p2x16_d8x4.yaml", planning=True)
    hw = Hardware(named_device("a3"))
    plan = plan_config(cfg, WorkloadSpec(65536, 3072), hw.spec)
    batch = plan.point.decode_batch
    (term,) = [t for t in plan.step_cost.terms if t.name == "TP collectives"]
    gather = batch * 129280 * 4 * 3 / 4 / hw.link(4) + hw.latency_s
    assert term.seconds == pytest.approx((2 * 43 + 1) * allreduce_s(hw, batch * 4096 * 2, 4)
                                         + gather)

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


def test_a3_v4_kv_tail_is_the_last_chunks_rows_whatever_layerwise_says():
    """V4 ships after each chunk's step (docs/kv_transfer.md "DeepSeek-V4"), not layer by
    layer: the plan's KV tail is the link's run over the chunks, each with the bytes of the
    rows it makes final (here, the link keeping up, the last chunk's share), the same with
    ``kv_transfer.layerwise`` on (the A3 config's default) or off, and the report says so."""
    from orchestrator.planner.kv_tail import staged_tail_s, v4_chunk_shares  # noqa: PLC0415
    from orchestrator.planner.report import format_plan  # noqa: PLC0415
    from engine.v4.row_layout import chunk_rows, layer_rows  # noqa: PLC0415
    from engine.v4.staging import kind_widths  # noqa: PLC0415

    cfg = load_config(REPO / "configs" / "a3_v4_p2x16_d8x4.yaml", planning=True)
    assert cfg.kv_transfer.layerwise
    off = cfg.model_copy(update={"kv_transfer": cfg.kv_transfer.model_copy(
        update={"layerwise": False})})
    wl = WorkloadSpec(65536, 3072, concurrency=1)
    on_plan, off_plan = (plan_config(c, wl, named_device("a3")) for c in (cfg, off))
    m = on_plan.memory.model
    shares = v4_chunk_shares(m, 65536, cfg.prefill.chunk_size)
    assert len(shares) == 8 and sum(shares) == pytest.approx(1.0)
    assert 0 < shares[-1] < 0.5 and min(shares) > 0  # NOTE: the state, window, last entries
    widths = kind_widths(m)
    own = sum(r * widths[k] for r, k in zip(layer_rows(m, 65536), m.layer_types, strict=True))
    assert shares[-1] * own == pytest.approx(sum(
        (r.end - r.start) * sum(widths[m.layer_types[i]] for i in r.layers)
        for r in chunk_rows(m, 65536, 7 * 8192, 65536)))
    transfer, prefill = on_plan.transfer.total_s, on_plan.prefill_cost.total_s
    assert on_plan.kv_tail_s == off_plan.kv_tail_s == pytest.approx(
        staged_tail_s(transfer, prefill, shares))
    assert transfer < prefill / 8  # NOTE: the link keeps up: the tail is the last chunk's rows
    assert on_plan.kv_tail_s == pytest.approx(shares[-1] * transfer)
    line = next(x for x in format_plan(on_plan) if x.startswith("kv transfer per request"))
    assert line.endswith("of it after the prefill forward (after each chunk's step)"), line


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

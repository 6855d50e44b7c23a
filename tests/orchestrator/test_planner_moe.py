"""The planner's MoE terms on DeepSeek-V3 by hand: redundant expert slots, the expert-load
imbalance (sampling noise, skew without EPLB, the drift with it) and the EP all-to-all
(DeepEP's normal and low-latency figures, the busiest receiver)."""

from __future__ import annotations

import math

import pytest

from orchestrator.planner.moe import (EPLB_DRIFT, SCALE_BYTES, StepOptions, alltoall_s,
                                      distinct, expected_max, experts_per_rank, imbalance,
                                      receive_excess)
from orchestrator.planner.specs import named_device
from tests.orchestrator.deepseek_v3 import v3


def test_redundant_experts_let_any_ep_size_hold_every_expert():
    m = v3()  # 256 routed experts
    assert experts_per_rank(m, 32) == 8
    assert experts_per_rank(m, 144) == 2  # 256 + 32 redundant = 288 slots (DeepSeek)
    assert experts_per_rank(m, 72, redundant=32) == 4  # LMSYS: 288 slots on EP72
    assert experts_per_rank(m, 320, redundant=64) == 1
    assert experts_per_rank(m, 1) == 256


def test_imbalance_is_the_busiest_ranks_sampling_noise_plus_skew_without_eplb():
    m = v3()  # top-8
    z2 = 0.5895  # Phi^-1((2 - 0.375) / (2 + 0.25)) = Phi^-1(0.7222) (exact E[max of 2]: 0.564)
    assert expected_max(2) == pytest.approx(z2, abs=1e-4)
    assert expected_max(32) == pytest.approx(2.0667, abs=1e-4)  # Phi^-1(31.625 / 32.25)
    assert expected_max(1) == 0.0
    on = imbalance(m, 2, 1, StepOptions(drift=0.0))  # 8 copies over 2 ranks: mean 4
    assert on == pytest.approx(1 + z2 * math.sqrt(1 / 4), abs=1e-4)
    off = imbalance(m, 2, 1, StepOptions(eplb=False, skew=0.5))  # 128 experts a rank
    assert off == pytest.approx(1 + z2 * math.sqrt(1 / 4 + 0.25 / 128), abs=1e-4)
    assert imbalance(m, 1, 100, StepOptions()) == 1.0
    assert imbalance(m, 32, 1e6, StepOptions(drift=0.0)) < 1.01  # uniform routing evens out


def test_eplb_leaves_the_drift_trt_llm_measured():
    """TensorRT-LLM blog 4, Table 1: EP32, 288 slots, offline EPLB: mean 1024 routed tokens a
    rank, (max - mean) / mean 0.109; the drift is solved at that setting."""
    m = v3()
    assert EPLB_DRIFT == pytest.approx(math.sqrt((0.109 / 2.0667) ** 2 - 1 / 1024), abs=1e-4)
    trt = imbalance(m, 32, 128 * 32, StepOptions())  # 128 tokens a rank x top-8: mean 1024
    assert trt == pytest.approx(1.109, abs=1e-3)
    # a prefill batch (16K tokens a rank): the sampling noise is gone, the drift is not
    big = imbalance(m, 32, 16384 * 32, StepOptions())
    assert big == pytest.approx(1 + 2.0667 * math.sqrt(1 / 131072 + 0.0425 ** 2), abs=1e-4)
    assert big > 1.08


def test_all_to_all_waits_for_the_busiest_receiver_beyond_the_libraries_figures():
    m, h800 = v3(), named_device("h800")
    uniform = 1 + 2.0667 * math.sqrt(1 / 1024)  # DeepEP's tests route uniformly at random
    real = 1 + 2.0667 * math.sqrt(1 / 1024 + 0.0425 ** 2)
    excess = receive_excess(m, 32, 128 * 32, StepOptions(), measured=True)
    assert excess == pytest.approx(real / uniform, abs=1e-4)  # ~1.042
    assert receive_excess(m, 32, 128 * 32, StepOptions(drift=0.0), measured=True) == 1.0
    assert receive_excess(m, 32, 128 * 32, StepOptions(), measured=False) == pytest.approx(
        real, abs=1e-4)  # plain links: no figure holds any of it
    base = alltoall_s(m, h800, 128, 32, decode=True, eight_bit=True, link_eff=0.7)
    hot = alltoall_s(m, h800, 128, 32, decode=True, eight_bit=True, link_eff=0.7, excess=1.2)
    assert hot == pytest.approx((base[0] * 1.2, base[1] * 1.2))  # each copy to its rank
    # prefill: the forwarding inside a node waits for the busiest rank; the inter-node path
    # carries a node's load (taken as balanced)
    one = alltoall_s(m, h800, 4096, 8, decode=False, eight_bit=True, link_eff=0.7)
    one_hot = alltoall_s(m, h800, 4096, 8, decode=False, eight_bit=True, link_eff=0.7,
                         excess=1.2)
    assert one_hot[0] == pytest.approx(one[0] * 1.2)
    four = alltoall_s(m, h800, 4096, 32, decode=False, eight_bit=True, link_eff=0.7)
    assert alltoall_s(m, h800, 4096, 32, decode=False, eight_bit=True, link_eff=0.7,
                      excess=1.2) == four  # RDMA-bound: 2.70 copies / 51 GB/s > 4.6 / 153


def test_low_latency_all_to_all_is_deepeps_table_per_expert_copy():
    m, h800 = v3(), named_device("h800")
    d, c = alltoall_s(m, h800, 128, 32, decode=True, eight_bit=True, link_eff=0.7)
    per_copy = 128 * 8 * 7168
    assert d == pytest.approx(58 * per_copy * (1 + SCALE_BYTES) / 48e9)  # EP32: 48 GB/s
    assert c == pytest.approx(58 * per_copy * 2 / 53e9)  # bf16 combine: 53 GB/s
    assert d / 58 == pytest.approx(155e-6, rel=0.02)  # DeepEP's published 155 us
    t = math.log2(24) - 4  # EP 24: this far (log2) from the EP16 row to the EP32 row
    assert h800.alltoall.low_latency_gb_s(24) == pytest.approx((63 + t * (48 - 63),
                                                                74 + t * (53 - 74)))
    assert h800.alltoall.low_latency_gb_s(4) == (98, 127)  # below the table: EP8's row
    tiny = alltoall_s(m, h800, 0.01, 32, decode=True, eight_bit=True, link_eff=0.7)
    assert tiny == pytest.approx((58 * 20e-6, 58 * 20e-6))  # the latency floor


def test_normal_all_to_all_sends_once_per_destination_domain():
    m, h800 = v3(), named_device("h800")
    tokens, b = 4096, 7168 * (1 + SCALE_BYTES)
    one_node, _ = alltoall_s(m, h800, tokens, 8, decode=False, eight_bit=True, link_eff=0.7)
    assert one_node == pytest.approx(58 * tokens * distinct(8, 8) * 7 / 8 * b / 153e9)
    four, _ = alltoall_s(m, h800, tokens, 32, decode=False, eight_bit=True, link_eff=0.7)
    assert distinct(4, 8) == pytest.approx(4 * (1 - 0.75 ** 8))
    assert four == pytest.approx(58 * tokens * distinct(4, 8) * 3 / 4 * b / 51e9)

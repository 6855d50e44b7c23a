"""The planner's kernel and collective terms on small hand-computed cases: kernel efficiencies
by precision, scale-up domains, the kernels between the GEMMs, prefill's prefix re-expansion
and causal attention rate, a cache hit's attention, and prefill's SP-TP-SP collectives."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.model_config import ModelConfig
from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.config.role_layout import RoleLayout
from orchestrator.planner.comm_terms import sp_tp_s
from orchestrator.planner.counts import elementwise_bytes_per_token, sp_tp_bytes
from orchestrator.planner.cost import decode_step_cost, forward_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.moe import StepOptions
from orchestrator.planner.specs import DeviceSpec, named_device
from orchestrator.planner.terms import Work
from tests.e2e.harness import REPO
from tests.orchestrator.deepseek_v3 import v3, v3_decode


def test_gemm_rate_follows_the_stored_precision_and_the_devices_8_bit_path():
    fp8, bf16 = Precision(1, 2, 2, 2), Precision(2, 2, 2, 2)
    h800, a3 = Hardware(named_device("h800")), Hardware(named_device("a3"))
    assert h800.gemm_flops(fp8) == pytest.approx(1979e12 * 0.56)  # DeepGEMM FP8
    assert h800.gemm_flops(bf16) == pytest.approx(989e12 * 0.56)
    assert a3.gemm_flops(fp8) == pytest.approx(752e12 * 0.80)  # no FP8: W8A8 INT8
    assert a3.attn_flops(decode=True) == pytest.approx(376e12 * 0.654)  # CloudMatrix MLA
    assert a3.hbm("attn_decode_hbm") == pytest.approx(1600e9 * 0.841)
    # an FP8 checkpoint kept 1 byte carries block scales (~1.0002 bytes a weight): 8-bit path
    stored = Precision(1.0002, 2, 2, 2)
    assert a3.gemm_flops(stored) == a3.gemm_flops(fp8)
    assert h800.gemm_flops(stored) == h800.gemm_flops(fp8)
    assert h800.hbm("attn_decode_hbm") == pytest.approx(3350e9 * 0.90)  # FlashMLA


def test_links_inside_a_scale_up_domain_and_beyond():
    h800, a3 = Hardware(named_device("h800")), Hardware(named_device("a3"))
    assert h800.link(8) == pytest.approx(160e9 * 0.7)
    assert h800.link(16) == pytest.approx(50e9 * 0.7)  # two HGX servers: InfiniBand
    assert a3.link(512) == pytest.approx(196e9 * 0.7)  # one CloudMatrix384 UB plane


def _tiny() -> ModelConfig:
    """3 layers (1 dense), hidden 8, 2 heads, latents 4 / 4, rope 2, nope 2, v 2, 4 experts
    top-2 of intermediate 3, 1 shared, dense intermediate 5."""
    return replace(v3(), hidden_size=8, num_attention_heads=2, q_lora_rank=4,
                   kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=2,
                   moe_intermediate_size=3, intermediate_size=5, n_routed_experts=4,
                   num_experts_per_tok=2, n_shared_experts=1, num_hidden_layers=3,
                   first_k_dense_replace=1)


def test_elementwise_bytes_by_hand_on_a_tiny_model():
    m = _tiny()  # bf16 activations (2 bytes), 8-bit GEMM inputs (quantize: read 2, write 1)
    # attention layer: add+norm 4*8*2=64, latent norms 2*(4+4)*2=32, RoPE 2*(2+1)*2*2=24,
    # quantize (8 + 4 + 2*2)*3=48 -> 168; dense MLP: 64 + 8*3 + SiLU-mul 9*5=45 -> 133
    # MoE layer: 64 + 24 + router 2*4*4=32 + shared 9*3=27 + combine (2+1)*8*2=48 -> 195
    assert elementwise_bytes_per_token(m, 2, True, prefill=False) == (3 * 168 + 133,
                                                                      2 * 195, 2 * 27)
    # prefill's MHA form also writes / reads per-head keys: 2*(2+4)*2 = 24 more a layer
    assert elementwise_bytes_per_token(m, 2, True, prefill=True)[0] == 3 * 192 + 133
    # bf16 GEMM inputs: no quantization; SiLU-mul 6 I
    assert elementwise_bytes_per_token(m, 2, False, prefill=False) == (3 * 120 + 94,
                                                                       2 * 162, 2 * 18)
    # prefill also moves each received copy into the expert-contiguous layout: read + write
    # 8 values at 1 byte + a 4-byte scale per 128 (8-bit), or at 2 bytes (bf16)
    assert elementwise_bytes_per_token(m, 2, True, prefill=True)[2] == pytest.approx(
        2 * (27 + 2 * 8 * (1 + 4 / 128)))
    assert elementwise_bytes_per_token(m, 2, False, prefill=True)[2] == 2 * (18 + 2 * 8 * 2)


def test_prefill_re_expands_the_prefix_latents_to_per_head_keys_and_values():
    from orchestrator.planner.counts import prefix_up_flops
    from orchestrator.planner.cost import forward_cost
    from orchestrator.planner.terms import Work

    m = _tiny()  # 3 layers x 2 x past 5 x kv_lora 4 x 2 heads x (qk_nope 2 + v 2)
    assert prefix_up_flops(m, 5) == 2 * 3 * 5 * 4 * 2 * 4
    assert prefix_up_flops(m, 0) == 0.0
    v32 = ModelConfig.from_dict(json.loads(
        (REPO / "configs" / "models" / "deepseek-v32" / "config.json").read_text()))
    assert prefix_up_flops(v32, 4096) == 0.0  # sparse attention runs absorbed
    # the linears term of a forward grows by those FLOPs at the linears' rate (compute-bound)
    m, lay = v3(), RoleLayout("prefill", 32, 1, True, 1, 128, 16384, 16384, 8192)
    prec, hw = Precision(1, 2, 2, 2), Hardware(named_device("h800"))
    plan = plan_role(replace(m, n_routed_experts=288), lay, prec)

    def linears_s(extra: float) -> float:
        cost = forward_cost(m, plan, prec, hw, StepOptions(overlap=False, redundant=32),
                            Work(16384, 0.0, 0.0, 0.0, False, extra))
        return next(t.seconds for t in cost.terms if t.name == "linears")

    assert linears_s(1e15) - linears_s(0.0) == pytest.approx(1e15 / hw.gemm_flops(prec))


def test_elementwise_terms_stream_at_the_devices_rate_and_stay_off_on_cpu():
    cost = v3_decode(StepOptions(overlap=False), 100)
    by_name = {t.name: t for t in cost.terms}
    # V3, 1 token: 61 x 173,824 B (attention layers) + 3 x 244,736 B (dense MLP layers)
    assert by_name["elementwise (attention)"].seconds == pytest.approx(
        100 * (61 * 173_824 + 3 * 244_736) / (3350e9 * 0.90))
    moe, copy = elementwise_bytes_per_token(v3(), 2, True, prefill=False)[1:]
    assert by_name["elementwise (MoE)"].seconds == pytest.approx(
        100 * (moe + 8 * cost.imbalance * copy) / (3350e9 * 0.90))
    assert by_name["elementwise (MoE)"].bound == "memory"
    cpu = DeviceSpec.from_dict("cpu", {**vars(named_device("h800")), "kernels": {}})
    m, lay = v3(), RoleLayout("decode", 144, 1, True, 1, 128, 512, 512, 8192)
    plan = plan_role(replace(m, n_routed_experts=288), lay, Precision(1, 2, 2, 2))
    names = {t.name for t in decode_step_cost(m, plan, Precision(1, 2, 2, 2), Hardware(cpu),
                                              100, 4096).terms}
    assert not any(n.startswith("elementwise") for n in names)


def test_cache_hit_prefill_attends_over_the_cached_prefix():
    from orchestrator.planner.validation import Published, row_cost

    def attention_s(length: int, hit: float) -> float:
        row = Published("x", "x", "h800", "prefill", 32, 32, length, 16384, 1.0, 8, "u",
                        hit=hit)
        return next(t.seconds for t in row_cost(row)[0].terms if t.name == "attention")

    # 16384 computed tokens either way: 8 prompts computing 2048 tokens each, after a
    # cached 2048-token prefix (keys 2048 * 2048 + 2048 * 2049 / 2) or after none; the
    # kernel's rate is the causal figure at twice the keys a query sees on average (2048 +
    # 1024.5: 6145 tokens; 1024.5: 2049)
    with_prefix, alone = 2048 * 2048 + 2048 * 2049 / 2, 2048 * 2049 / 2
    k = named_device("h800").kernels
    assert attention_s(4096, 0.5) / attention_s(2048, 0.0) == pytest.approx(
        with_prefix / alone * k.causal_prefill(2049) / k.causal_prefill(6145))


def test_dense_prefill_attention_runs_at_the_causal_kernels_rate_for_its_length():
    """MHA-form (dense MLA) prefill attention at FlashAttention-3's causal figure for the
    prompt's length (devices.yaml attn_prefill_causal), interpolated in log2(length)."""
    from orchestrator.planner.counts import attention_flops, mha_keys
    from orchestrator.planner.specs import Kernels

    k = named_device("h100").kernels
    assert k.causal_prefill(2048) == pytest.approx(0.535)  # (521 + 537) / 2 / 989
    assert k.causal_prefill(2 ** 11.5) == pytest.approx((0.535 + 0.602) / 2)  # 2K..4K midway
    assert k.causal_prefill(100) == 0.292 and k.causal_prefill(65536) == 0.636  # the ends
    # a table as devices.yaml's mapping or as a cached device's lists; none: attn_prefill
    table = Kernels(attn_prefill_causal={4096: 0.6, 1024: 0.4})
    assert table == Kernels(attn_prefill_causal=[[1024, 0.4], [4096, 0.6]])
    assert table.causal_prefill(2048) == pytest.approx(0.5)
    assert Kernels(attn_prefill=0.65).causal_prefill(2048) == 0.65
    # the keys a query sees on average: a whole 2048-token prompt, a chunk after 3072 tokens
    m = v3()
    assert mha_keys(m, 2048, 0) == 1024.5
    assert mha_keys(m, 1024, 3072) == 3072 + 512.5
    v32 = ModelConfig.from_dict(json.loads(
        (REPO / "configs" / "models" / "deepseek-v32" / "config.json").read_text()))
    assert mha_keys(v32, 2048, 0) == 0.0  # sparse attention runs absorbed: attn_prefill
    hw = Hardware(named_device("h100"))
    assert hw.attn_flops(False, 1024.5) == pytest.approx(989e12 * k.causal_prefill(2049))
    assert hw.attn_flops(False) == pytest.approx(989e12 * 0.65)
    assert hw.attn_flops(True, 1024.5) == pytest.approx(989e12 * 0.67)  # decode: FlashMLA
    # the attention term of one forward of 8 whole 2048-token prompts on a rank
    lay = RoleLayout("prefill", 32, 1, True, 1, 128, 16384, 16384, 8192)
    prec = Precision(1, 2, 2, 2)
    plan = plan_role(replace(m, n_routed_experts=288), lay, prec)
    flops = 8 * attention_flops(m, 2048, 0, absorbed=False)
    cost = forward_cost(m, plan, prec, hw, StepOptions(overlap=False, redundant=32),
                        Work(16384, flops, 0.0, 0.0, False, 0.0, 1024.5))
    term = next(t for t in cost.terms if t.name == "attention")
    assert term.seconds == pytest.approx(flops / (989e12 * k.causal_prefill(2049)))
    assert term.bound == "compute"


def test_sp_tp_sp_collectives_by_hand():
    """CloudMatrix-Infer's prefill MLA (SP-TP-SP): one all-gather of the latents and one
    all-to-all of the attention output per layer, a serial term of prefill only."""
    from orchestrator.planner.validation import Published, row_cost

    m = v3()
    gathered, a2a = sp_tp_bytes(m, 8192, 32, 2)
    # the other 31 ranks' 8192 tokens x (q latent 1536 + KV latent 512 + k_pe 64) in bf16
    assert gathered == 31 * 8192 * 2112 * 2 == 1_072_693_248
    # 31/32 of (32 x 8192 rows x 4 of 128 heads x 128 v values) in bf16 leaves the rank
    assert a2a == 31 * 8192 * 4 * 128 * 2 == 260_046_848
    assert sp_tp_bytes(m, 8192, 1, 2) == (0.0, 0.0)
    a3 = Hardware(named_device("a3"))
    # 61 layers, each both collectives at the UB link x 0.70 and a 20 us latency each per
    # micro-batch
    per_layer = (gathered + a2a) / (196e9 * 0.70) + 2 * 2 * 20e-6
    assert sp_tp_s(m, a3, 8192, 32, 2, batches=2) == pytest.approx(61 * per_layer)
    row = Published("x", "x", "a3", "prefill", 32, 0, 4096, 8192, 1.0, 2, "u", attn_tp=32)
    cost = row_cost(row)[0]
    term = next(t for t in cost.terms if t.name == "SP-TP-SP collectives")
    assert term.phase == "serial" and term.bound == "link"
    assert term.seconds == pytest.approx(sp_tp_s(m, a3, 8192, 32, 2, 2 if cost.overlap else 1))
    plain = row_cost(replace(row, attn_tp=1))[0]
    assert all(t.name != "SP-TP-SP collectives" for t in plain.terms)
    assert cost.total_s - plain.total_s == pytest.approx(term.seconds, rel=1e-3)
    lay = RoleLayout("decode", 32, 1, True, 1, 128, 8, 8, 5120)
    prec = Precision(1, 2, 2, 2)
    dec = decode_step_cost(m, plan_role(m, lay, prec), prec, a3, 8, 4096,
                           StepOptions(attn_tp=32))
    assert all(t.name != "SP-TP-SP collectives" for t in dec.terms)  # prefill only

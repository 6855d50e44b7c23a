"""The planner's step terms on small hand-computed cases: kernel efficiencies by precision,
scale-up domains, the EP all-to-all (DeepEP's normal and low-latency figures), two-batch
overlap, MTP, expert-load imbalance, redundant experts, --explain and the validation page."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from engine.model_config import ModelConfig
from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.config.role_layout import RoleLayout
from orchestrator.planner.counts import elementwise_bytes_per_token, sp_tp_bytes
from orchestrator.planner.comm_terms import sp_tp_s
from orchestrator.planner.cost import decode_step_cost, forward_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.terms import Cost, Term, Work
from orchestrator.planner.load import parse_workload
from orchestrator.planner.moe import (EPLB_DRIFT, SCALE_BYTES, StepOptions, alltoall_s,
                                      distinct, expected_max, experts_per_rank, imbalance,
                                      receive_excess)
from orchestrator.planner.specs import DeviceSpec, named_device
from tests.e2e.harness import REPO


def _v3() -> ModelConfig:
    return ModelConfig.from_dict(json.loads(
        (REPO / "configs" / "models" / "deepseek-v3" / "config.json").read_text()))


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


def test_redundant_experts_let_any_ep_size_hold_every_expert():
    m = _v3()  # 256 routed experts
    assert experts_per_rank(m, 32) == 8
    assert experts_per_rank(m, 144) == 2  # 256 + 32 redundant = 288 slots (DeepSeek)
    assert experts_per_rank(m, 72, redundant=32) == 4  # LMSYS: 288 slots on EP72
    assert experts_per_rank(m, 320, redundant=64) == 1
    assert experts_per_rank(m, 1) == 256


def test_imbalance_is_the_busiest_ranks_sampling_noise_plus_skew_without_eplb():
    m = _v3()  # top-8
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
    m = _v3()
    assert EPLB_DRIFT == pytest.approx(math.sqrt((0.109 / 2.0667) ** 2 - 1 / 1024), abs=1e-4)
    trt = imbalance(m, 32, 128 * 32, StepOptions())  # 128 tokens a rank x top-8: mean 1024
    assert trt == pytest.approx(1.109, abs=1e-3)
    # a prefill batch (16K tokens a rank): the sampling noise is gone, the drift is not
    big = imbalance(m, 32, 16384 * 32, StepOptions())
    assert big == pytest.approx(1 + 2.0667 * math.sqrt(1 / 131072 + 0.0425 ** 2), abs=1e-4)
    assert big > 1.08


def test_all_to_all_waits_for_the_busiest_receiver_beyond_the_libraries_figures():
    m, h800 = _v3(), named_device("h800")
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
    m, h800 = _v3(), named_device("h800")
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
    m, h800 = _v3(), named_device("h800")
    tokens, b = 4096, 7168 * (1 + SCALE_BYTES)
    one_node, _ = alltoall_s(m, h800, tokens, 8, decode=False, eight_bit=True, link_eff=0.7)
    assert one_node == pytest.approx(58 * tokens * distinct(8, 8) * 7 / 8 * b / 153e9)
    four, _ = alltoall_s(m, h800, tokens, 32, decode=False, eight_bit=True, link_eff=0.7)
    assert distinct(4, 8) == pytest.approx(4 * (1 - 0.75 ** 8))
    assert four == pytest.approx(58 * tokens * distinct(4, 8) * 3 / 4 * b / 51e9)


def test_overlap_pairs_each_phase_with_the_other_micro_batchs_all_to_all():
    terms = (Term("a0", "attention-0", 1.0, "compute"), Term("a1", "attention", 2.0, "compute"),
             Term("s", "shared", 0.5, "compute"), Term("m", "moe", 2.0, "compute"),
             Term("d", "dispatch", 4.0, "link"), Term("c", "combine", 1.0, "link"),
             Term("x", "serial", 0.5, "host"))
    # DeepSeek's prefill: [A+S] | C, A | D, M | D, [M+S] | C, each per micro-batch (half)
    assert Cost(terms, "prefill").total_s == pytest.approx(
        (max(3.5, 1) + max(3, 4) + max(2, 4) + max(2.5, 1)) / 2 + 0.5)
    # DeepSeek's decode: [S + A0] | D, M alone, A1 | C (both micro-batches: the totals)
    assert Cost(terms, "decode").total_s == pytest.approx(max(1.5, 4) + 2 + max(2, 1) + 0.5)
    assert Cost(terms).total_s == pytest.approx(11.0)
    assert Cost(terms, "decode").overlap and not Cost(terms).overlap
    with pytest.raises(ValueError, match="unknown overlap schedule"):
        Cost(terms, "zigzag").total_s


def _decode(opts: StepOptions, batch: float, device: str = "h800") -> Cost:
    m = _v3()
    lay = RoleLayout("decode", 144, 1, True, 1, 128, 512, 512, 8192)
    prec = Precision(1, 2, 2, 2)
    # NOTE: EP 144 holds 256 experts plus redundant copies: the memory plan sees the slots
    plan = plan_role(replace(m, n_routed_experts=experts_per_rank(m, 144) * 144), lay, prec)
    return decode_step_cost(m, plan, prec, Hardware(named_device(device)), batch, 4096, opts)


def test_mtp_verifies_1_plus_k_tokens_and_gains_1_plus_accepted():
    assert StepOptions(mtp=1, accept=0.8).tokens_per_step() == pytest.approx(1.8)
    assert StepOptions(mtp=2, accept=0.5).tokens_per_step() == pytest.approx(1.75)
    mtp, plain = _decode(StepOptions(mtp=1, accept=0.8, overlap=False), 256), \
        _decode(StepOptions(overlap=False), 512)
    assert mtp.tokens_per_step == pytest.approx(1.8)
    by_name = {t.name: t.seconds for t in mtp.terms}
    plain_names = {t.name: t.seconds for t in plain.terms}
    for name in ("linears", "output linears", "routed experts", "all-to-all dispatch"):
        assert by_name[name] == pytest.approx(plain_names[name], rel=1e-9)
    assert by_name["MTP drafts"] > 0


def test_mtp_draft_runs_the_module_its_all_to_all_and_the_whole_output_head():
    """DeepSeek-V3's MTP module (report sec. 2.2): eh_proj [h, 2h], one Transformer block,
    the shared output head; per draft, on the batch."""
    two, one = _decode(StepOptions(mtp=2, accept=0.8, overlap=False), 64), \
        _decode(StepOptions(mtp=1, accept=0.8, overlap=False), 64)
    terms = {t.name: t for t in one.terms}
    head = terms["MTP draft head"]
    # 129280 x 7168 bf16 lm_head + 2 x 7168 x 7168 bf16 eh_proj read at 3350 GB/s x 0.67;
    # FLOPs 2 x 64 x 7168 x (129280 + 2 x 7168) at 989 TFLOPS x 0.56: memory-bound
    nbytes = 129280 * 7168 * 2 + 2 * 7168 * 7168 * 2
    flops = 2 * 64 * 7168 * (129280 + 2 * 7168)
    assert head.bound == "memory" and flops / (989e12 * 0.56) < nbytes / (3350e9 * 0.67)
    assert head.seconds == pytest.approx(nbytes / (3350e9 * 0.67))
    # the block: a plain step's kernels over 61 layers plus its all-to-all over 58 MoE layers
    m = _v3()
    lay = RoleLayout("decode", 144, 1, True, 1, 128, 512, 512, 8192)
    prec = Precision(1, 2, 2, 2)
    plan = plan_role(replace(m, n_routed_experts=experts_per_rank(m, 144) * 144), lay, prec)
    base = forward_cost(m, plan, prec, Hardware(named_device("h800")),
                        StepOptions(overlap=False), Work(64, 0.0, 0.0, 64, True))
    block = sum(t.seconds for t in base.terms if t.phase in ("attention-0", "attention",
                                                             "shared", "moe")) / 61 \
        + sum(t.seconds for t in base.terms if t.phase in ("dispatch", "combine")) / 58
    assert terms["MTP drafts"].seconds == pytest.approx(block)
    two_terms = {t.name: t.seconds for t in two.terms}
    assert two_terms["MTP draft head"] == pytest.approx(2 * head.seconds)  # per draft


def test_auto_overlap_takes_two_micro_batches_only_where_they_pay():
    big, small = _decode(StepOptions(), 256), _decode(StepOptions(), 1)
    forced = _decode(StepOptions(overlap=True), 1)
    assert big.overlap and not small.overlap and forced.overlap
    assert forced.total_s > small.total_s  # weights read twice at batch 1


def test_workload_takes_the_step_options():
    wl = parse_workload("in=4096,out=512,mtp=1,accept=0.8,overlap=0,eplb=0,skew=0.3,"
                        "redundant=32,sptp=16,drift=0")
    assert wl.options == StepOptions(overlap=False, mtp=1, accept=0.8, eplb=False, skew=0.3,
                                     redundant=32, attn_tp=16, drift=0.0)
    assert parse_workload("in=8,out=2").options == StepOptions()
    for bad in ("in=8,out=2,accept=0.5", "in=8,out=2,mtp=1,accept=2", "in=8,out=2,overlap=2",
                "in=8,out=2,mtp=-1", "in=8,out=2,eplb=yes", "in=8,out=2,sptp=0",
                "in=8,out=2,drift=-0.1"):
        with pytest.raises(ValueError):
            parse_workload(bad)


def _tiny() -> ModelConfig:
    """3 layers (1 dense), hidden 8, 2 heads, latents 4 / 4, rope 2, nope 2, v 2, 4 experts
    top-2 of intermediate 3, 1 shared, dense intermediate 5."""
    return replace(_v3(), hidden_size=8, num_attention_heads=2, q_lora_rank=4,
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
    m, lay = _v3(), RoleLayout("prefill", 32, 1, True, 1, 128, 16384, 16384, 8192)
    prec, hw = Precision(1, 2, 2, 2), Hardware(named_device("h800"))
    plan = plan_role(replace(m, n_routed_experts=288), lay, prec)

    def linears_s(extra: float) -> float:
        cost = forward_cost(m, plan, prec, hw, StepOptions(overlap=False, redundant=32),
                            Work(16384, 0.0, 0.0, 0.0, False, extra))
        return next(t.seconds for t in cost.terms if t.name == "linears")

    assert linears_s(1e15) - linears_s(0.0) == pytest.approx(1e15 / hw.gemm_flops(prec))


def test_elementwise_terms_stream_at_the_devices_rate_and_stay_off_on_cpu():
    cost = _decode(StepOptions(overlap=False), 100)
    by_name = {t.name: t for t in cost.terms}
    # V3, 1 token: 61 x 173,824 B (attention layers) + 3 x 244,736 B (dense MLP layers)
    assert by_name["elementwise (attention)"].seconds == pytest.approx(
        100 * (61 * 173_824 + 3 * 244_736) / (3350e9 * 0.90))
    moe, copy = elementwise_bytes_per_token(_v3(), 2, True, prefill=False)[1:]
    assert by_name["elementwise (MoE)"].seconds == pytest.approx(
        100 * (moe + 8 * cost.imbalance * copy) / (3350e9 * 0.90))
    assert by_name["elementwise (MoE)"].bound == "memory"
    cpu = DeviceSpec.from_dict("cpu", {**vars(named_device("h800")), "kernels": {}})
    m, lay = _v3(), RoleLayout("decode", 144, 1, True, 1, 128, 512, 512, 8192)
    plan = plan_role(replace(m, n_routed_experts=288), lay, Precision(1, 2, 2, 2))
    names = {t.name for t in decode_step_cost(m, plan, Precision(1, 2, 2, 2), Hardware(cpu),
                                              100, 4096).terms}
    assert not any(n.startswith("elementwise") for n in names)


def test_explain_prints_every_term_and_what_bounds_the_step(capsys):
    from orchestrator.cli import main

    assert main(["plan", str(REPO / "configs" / "a3_v32_p2x16_d8x4.yaml"), "--workload",
                 "in=65536,out=3072,concurrency=29,mtp=1,accept=0.7", "--explain"]) == 0
    out = capsys.readouterr().out
    for word in ("linears [attention", "attention [attention", "routed experts [moe",
                 "all-to-all dispatch [dispatch", "all-to-all combine [combine",
                 "TP collectives [serial", "MTP drafts", "MTP: 1.7 tokens per step",
                 "expert-load imbalance", "overlap (two micro-batches, prefill schedule",
                 "elementwise (attention) [attention-0, memory]", "elementwise (MoE) [moe",
                 "output linears [attention", "shared experts [shared"):
        assert word in out, word


def test_validation_page_shows_the_tables_figures():
    from orchestrator.planner.validation import summary, table

    rows = table()
    text = (REPO / "docs" / "planner.md").read_text()
    assert summary(rows) in text
    for r in rows:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert f"| {r['key']} |" in text
    from orchestrator.planner.validation import CHECKS, markdown

    assert markdown(rows) in text  # the tables as `--markdown` prints them
    assert all(f"| {c.key} |" in text for c in CHECKS)
    devices = {r["device"] for r in rows if r["role"] != "seed"}
    assert {"h800", "h100", "a3"} <= devices  # NVIDIA and Huawei chips
    # the goal set is the capacity rows; the fleet averages are shown as the utilization
    # they imply (published / predicted), not counted in the error
    capacity = [r for r in rows if r["role"] != "seed" and not r["fleet"]]
    assert f"over {len(capacity)} capacity throughputs" in summary(rows)
    for r in rows:
        if r["fleet"]:
            assert f"{r['key']} {1 / r['ratio']:.2f}" in summary(rows)


def test_validation_row_command_prints_the_rows_terms(capsys):
    from orchestrator.planner.validation import ROWS, main, row_cost

    assert main(["--row", "cm384-decode"]) == 0
    out = capsys.readouterr().out
    row = next(r for r in ROWS if r.key == "cm384-decode")
    assert f"ratio {row_cost(row)[1] / row.figure:.2f}" in out
    assert "MTP: 1.7 tokens per step" in out and "all-to-all combine" in out


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
    m = _v3()
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

    m = _v3()
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

"""The planner's step options by hand: two-batch overlap (DeepSeek's prefill and decode
schedules, on only where it pays), MTP (1 + k verified tokens, the draft module and its
output head) and the workload keys that set them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.config.role_layout import RoleLayout
from orchestrator.planner.cost import forward_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.load import parse_workload
from orchestrator.planner.moe import StepOptions, experts_per_rank
from orchestrator.planner.specs import named_device
from orchestrator.planner.terms import Cost, Term, Work
from tests.orchestrator.deepseek_v3 import v3, v3_decode


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


def test_mtp_verifies_1_plus_k_tokens_and_gains_1_plus_accepted():
    assert StepOptions(mtp=1, accept=0.8).tokens_per_step() == pytest.approx(1.8)
    assert StepOptions(mtp=2, accept=0.5).tokens_per_step() == pytest.approx(1.75)
    mtp, plain = v3_decode(StepOptions(mtp=1, accept=0.8, overlap=False), 256), \
        v3_decode(StepOptions(overlap=False), 512)
    assert mtp.tokens_per_step == pytest.approx(1.8)
    by_name = {t.name: t.seconds for t in mtp.terms}
    plain_names = {t.name: t.seconds for t in plain.terms}
    for name in ("linears", "output linears", "routed experts", "all-to-all dispatch"):
        assert by_name[name] == pytest.approx(plain_names[name], rel=1e-9)
    assert by_name["MTP drafts"] > 0


def test_mtp_draft_runs_the_module_its_all_to_all_and_the_whole_output_head():
    """DeepSeek-V3's MTP module (report sec. 2.2): eh_proj [h, 2h], one Transformer block,
    the shared output head; per draft, on the batch."""
    two, one = v3_decode(StepOptions(mtp=2, accept=0.8, overlap=False), 64), \
        v3_decode(StepOptions(mtp=1, accept=0.8, overlap=False), 64)
    terms = {t.name: t for t in one.terms}
    head = terms["MTP draft head"]
    # 129280 x 7168 bf16 lm_head + 2 x 7168 x 7168 bf16 eh_proj read at 3350 GB/s x 0.67;
    # FLOPs 2 x 64 x 7168 x (129280 + 2 x 7168) at 989 TFLOPS x 0.56: memory-bound
    nbytes = 129280 * 7168 * 2 + 2 * 7168 * 7168 * 2
    flops = 2 * 64 * 7168 * (129280 + 2 * 7168)
    assert head.bound == "memory" and flops / (989e12 * 0.56) < nbytes / (3350e9 * 0.67)
    assert head.seconds == pytest.approx(nbytes / (3350e9 * 0.67))
    # the block: a plain step's kernels over 61 layers plus its all-to-all over 58 MoE layers
    m = v3()
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
    big, small = v3_decode(StepOptions(), 256), v3_decode(StepOptions(), 1)
    forced = v3_decode(StepOptions(overlap=True), 1)
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

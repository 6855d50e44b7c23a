"""The kernel terms of one forward pass: each its roofline ``max(FLOPs / (peak x kernel
efficiency), bytes / (HBM x efficiency))``, the FLOPs split over the DP rank's ``tp x cp``
ranks.

Before the attention core, the MLA / indexer / dense-MLP linears at the linears' GEMM
precision (and the kernels between them); the attention core with the output projection,
router gate and lm_head; the shared experts; the routed experts x the expert-load imbalance
(and the kernels between them, :func:`.counts.elementwise_bytes_per_token`).
"""

from __future__ import annotations

from engine.model_config import ModelConfig
from orchestrator.config.memory_plan import Precision, RolePlan
from orchestrator.config.memory_plan_v4 import V4Precision
from orchestrator.config.weight_rows import num_moe_layers
from orchestrator.planner.hardware import GBPS, TFLOPS, Hardware, eight_bit
from orchestrator.planner.moe import StepOptions, experts_per_rank, imbalance
from orchestrator.planner.overlap import ATTN, MOE, PRE, SHARED
from orchestrator.planner.terms import Term, Work, counts_for, roofline


def expert_bytes_per_el(prec: Precision) -> float:
    """Bytes per routed-expert weight: DeepSeek-V4's own (FP4 in the release), else the
    linears'."""
    return prec.expert if isinstance(prec, V4Precision) else prec.linear


def kernel_terms(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
                 opts: StepOptions, w: Work) -> tuple[list[Term], float]:
    """The kernel terms of one pass and the EP imbalance they ran with."""
    c = counts_for(m)
    lay = plan.layout
    ranks = lay.tp * lay.cp
    rows = {r.kind: r.bytes for r in plan.rows}
    gemm, hbm = hw.gemm_flops(prec), hw.hbm()
    moe_kinds = ("routed experts", "shared experts", "embedding")
    dense_bytes = plan.bytes_of("weights") - sum(rows.get(k, 0) for k in moe_kinds)
    dense = c.dense_params_per_token(m)
    out_share = c.output_params_per_token(m) / dense
    dense_flops = 2 * w.tokens * dense / ranks
    lm_flops = 2 * w.lm_rows * m.hidden_size * m.vocab_size / lay.tp
    lm_rate = hw.spec.bf16_tflops * TFLOPS * hw.spec.kernels.gemm_bf16
    terms = [roofline("linears", PRE, dense_flops * (1 - out_share) + w.prefix_flops / ranks,
                       gemm,
                       dense_bytes * (1 - out_share), hbm),
             roofline("output linears", ATTN, dense_flops * out_share, gemm,
                       dense_bytes * out_share, hbm),
             roofline("attention", ATTN, w.attn_flops / ranks,
                       hw.attn_flops(w.decode, w.mha_keys), w.kv_bytes,
                       hw.hbm("attn_decode_hbm"))]
    if lm_flops:
        terms.append(Term("lm_head", ATTN, lm_flops / lm_rate, "compute"))
    if not m.n_routed_experts:
        return terms, 1.0
    group_tokens = w.tokens * (lay.dp if lay.ep else 1)
    imb = imbalance(m, lay.ep_size, group_tokens, opts) if lay.ep else 1.0
    terms.append(roofline("shared experts", SHARED,
                           2 * w.tokens * c.shared_params_per_token(m) / ranks, gemm,
                           rows.get("shared experts", 0), hbm))
    active = c.expert_active_share(m, group_tokens)
    if lay.ep:
        held = experts_per_rank(m, lay.ep_size, opts.redundant)
        expert_bytes = num_moe_layers(m) * held * c.expert_params(m) * expert_bytes_per_el(prec)
    else:
        expert_bytes = rows.get("routed experts", 0)
    masked = hw.spec.kernels.gemm_masked if w.decode else 1.0
    terms.append(roofline("routed experts", MOE,
                           2 * w.tokens * c.routed_params_per_token(m) / ranks * imb,
                           gemm * masked, expert_bytes * active, hbm))
    return terms + _elementwise(m, prec, hw, w, ranks, imb), imb


def _elementwise(m: ModelConfig, prec: Precision, hw: Hardware, w: Work, ranks: int,
                 imb: float) -> list[Term]:
    """The kernels between the GEMMs (:func:`.counts.elementwise_bytes_per_token`) at the
    device's streaming rate, the tokens split over the DP rank's ``ranks`` like the GEMMs'
    (NOTE: under TP the hidden-size norms are in fact repeated on every TP rank; counted
    once); routed copies x the EP imbalance. None where the device does not model them."""
    c = counts_for(m)
    eff = hw.spec.kernels.elementwise_hbm
    if eff <= 0:
        return []
    attn, moe, per_copy = c.elementwise_bytes_per_token(
        m, prec.activation, eight_bit(prec), prefill=not w.decode)
    bw = hw.spec.hbm_gb_s * GBPS * eff
    copies = m.num_experts_per_tok * imb
    return [Term("elementwise (attention)", PRE, w.tokens / ranks * attn / bw, "memory"),
            Term("elementwise (MoE)", MOE, w.tokens / ranks * (moe + copies * per_copy) / bw,
                 "memory")]

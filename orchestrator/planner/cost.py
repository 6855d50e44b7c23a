"""Seconds of one prefill and one decode step, term by term.

A forward pass of ``tokens`` tokens on one DP rank (:class:`.terms.Work`) is a list of
:class:`.terms.Term`:

- kernels (:mod:`.kernel_terms`), each its roofline ``max(FLOPs / (peak x kernel
  efficiency), bytes / (HBM x efficiency))``: before the attention core (MLA / indexer /
  dense-MLP linears at the linears' GEMM precision, the kernels between them), the attention
  core with the output projection, router gate and lm_head, the shared experts, the routed
  experts x the expert-load imbalance (and the kernels between them), split over the DP
  rank's ``tp x cp`` ranks;
- the EP all-to-all dispatch and combine (:mod:`.moe`);
- serial terms: TP all-reduces (ring: ``2 (n-1)/n`` of the bytes) and the vocab-parallel
  collectives, context-parallel gathers, prefill's SP-TP-SP collectives (:mod:`.comm_terms`),
  host dispatch, the step call, serving cost (:mod:`.host_terms`), the MTP draft module (its
  block and its output head).

Without overlap the step is the sum. With two micro-batches (:class:`.moe.StepOptions`) each
kernel runs twice on half the tokens (weights read twice), compute-bound kernels under the
prefill all-to-all lose the share of compute units its kernels hold, and the phases add up
as DeepSeek's prefill or decode schedule pairs them with the other micro-batch's
all-to-all (:mod:`.overlap`). The linears run at the 8-bit peak when they are stored in one byte
(FP8 where the device has it, else INT8), else at the bf16 peak (:class:`.hardware.Hardware`).
A request's KV transfer is :func:`.comm_terms.kv_transfer_cost`.
"""

from __future__ import annotations

from dataclasses import replace

from engine.model_config import ModelConfig
from orchestrator.config.memory_plan import Precision, RolePlan
from orchestrator.config.role_layout import RoleLayout
from orchestrator.config.weight_rows import num_moe_layers
from orchestrator.planner.comm_terms import cp_gathers_s, sp_tp_s, tp_collectives_s
from orchestrator.planner.hardware import TFLOPS, Hardware, eight_bit
from orchestrator.planner.host_terms import host_s, serving_s, step_call_s
from orchestrator.planner.kernel_terms import kernel_terms
from orchestrator.planner.moe import StepOptions, alltoall_s, receive_excess
from orchestrator.planner.overlap import (ATTN, COMBINE, DECODE, DISPATCH, MOE, NONE, PRE,
                                          PREFILL, SERIAL, SHARED)
from orchestrator.planner.terms import Cost, Term, Work, counts_for, roofline


def overlap_on(lay: RoleLayout, hw: Hardware, opts: StepOptions) -> bool:
    """The option, else on for an EP layout on an accelerator (SGLang / DeepSeek large EP
    run two micro-batches; orch's cpu engine does not)."""
    if opts.overlap is not None:
        return opts.overlap
    return lay.ep and lay.ep_size > 1 and hw.spec.platform != "cpu"


def forward_cost(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
                 opts: StepOptions, w: Work) -> Cost:
    """One forward pass of one DP rank (module docstring): kernels, all-to-alls, TP
    collectives and host costs; with ``opts.overlap`` None (auto) on an EP layout, the
    faster of one batch and two micro-batches (engines enable two-batch overlap where it
    pays: at a small decode batch the second weight read costs more than it hides)."""
    lay = plan.layout
    if opts.overlap is None and overlap_on(lay, hw, opts):
        one, two = (_forward(m, plan, prec, hw, opts, w, n) for n in (1, 2))
        return two if two.total_s < one.total_s else one
    return _forward(m, plan, prec, hw, opts, w, 2 if overlap_on(lay, hw, opts) else 1)


def _forward(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
             opts: StepOptions, w: Work, n: int) -> Cost:
    """:func:`forward_cost` in ``n`` micro-batches (1 or 2: overlapped)."""
    lay = plan.layout
    part = w.half() if n == 2 else w
    kernels, imb = kernel_terms(m, plan, prec, hw, opts, part)
    a2a = hw.spec.alltoall
    slow = 1 / (1 - a2a.normal_sm_share) if n == 2 and lay.ep and a2a and not w.decode \
        else 1.0  # the normal kernels' SMs, taken from computation under them
    terms = [replace(t, seconds=t.seconds * n * (slow if t.bound == "compute" else 1.0))
             for t in kernels]
    if lay.ep:
        excess = receive_excess(m, lay.ep_size, part.tokens * lay.dp, opts, a2a is not None)
        d, c = alltoall_s(m, hw.spec, part.tokens / (lay.tp * lay.cp), lay.ep_size,
                          w.decode, eight_bit(prec), hw.spec.kernels.link, excess)
        terms += [Term("all-to-all dispatch", DISPATCH, d * n, "link"),
                  Term("all-to-all combine", COMBINE, c * n, "link")]
    if opts.attn_tp > 1 and not w.decode:
        terms.append(Term("SP-TP-SP collectives", SERIAL,
                          sp_tp_s(m, hw, w.tokens / (lay.tp * lay.cp), opts.attn_tp,
                                  prec.activation, n), "link"))
    terms += [Term("TP collectives", SERIAL, tp_collectives_s(m, lay, hw, w, prec.activation),
                   "link"),
              Term("host", SERIAL, host_s(m, lay, hw, w.tokens) + step_call_s(lay, hw)
                   + serving_s(hw), "host")]
    schedule = NONE if n == 1 else (DECODE if w.decode else PREFILL)
    return Cost(tuple(terms), schedule, 1.0, imb)


def prefill_cost(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
                 prompt: int, chunk: int, opts: StepOptions = StepOptions(),
                 cached: int = 0) -> Cost:
    """One prompt of ``prompt`` tokens on one prefill DP rank whose first ``cached`` tokens
    are in the prefix cache: the rest in chunks of ``chunk`` tokens, each a forward pass over
    the prefix before it (the cached one included: its attention reads that KV).

    With ``cp`` (context parallel, seed 004's DSA-CP) each of the DP rank's ``cp`` ranks
    computes ``1 / cp`` of the tokens with all heads and the K/V latents of each chunk are
    all-gathered; layer-sharded weights' broadcasts are taken as hidden behind compute.

    Raises:
        ValueError: ``cached`` outside [0, prompt - 1] (the last prompt token is computed).
    """
    c = counts_for(m)
    if not 0 <= cached < prompt:
        raise ValueError(f"prefill_cost: cached ({cached}) must be in [0, prompt - 1 = "
                         f"{prompt - 1}]")
    lay = plan.layout
    total, past = None, cached
    while past < prompt:
        new = min(chunk, prompt - past)
        w = Work(new, c.attention_flops(m, new, past, absorbed=False), 0.0, 0.0, False,
                 c.prefix_up_flops(m, past), c.mha_keys(m, new, past))
        step = forward_cost(m, plan, prec, hw, opts, w)
        total = step if total is None else total + step
        past += new
    if lay.cp > 1:
        gather = cp_gathers_s(m, lay, prec, hw, prompt - cached, chunk)
        total = total + Cost((Term("CP gathers", SERIAL, gather, "link"),))
    return total


def decode_step_cost(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
                     batch: float, context: float, opts: StepOptions = StepOptions()) -> Cost:
    """One decode step of ``batch`` sequences of ``context`` tokens on one decode DP rank
    (with ``ep`` every DP rank steps together with the same batch). With MTP each sequence
    verifies ``1 + mtp`` tokens (absorbed attention over the same KV) and the draft module
    (one layer-like block) runs ``mtp`` times on the batch."""
    c = counts_for(m)
    q = 1 + opts.mtp
    w = Work(batch * q, batch * c.attention_flops(m, q, int(context), absorbed=True),
             batch * c.kv_read_per_seq(m, prec, context), batch * q, True)
    cost = forward_cost(m, plan, prec, hw, opts, w)
    if opts.mtp:
        cost = cost + Cost(_mtp_draft_terms(m, plan, prec, hw, batch, opts))
    return replace(cost, tokens_per_step=opts.tokens_per_step())


def _mtp_draft_terms(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
                     batch: float, opts: StepOptions) -> tuple[Term, ...]:
    """The MTP module run ``opts.mtp`` times on ``batch`` rows (DeepSeek-V3 report sec. 2.2:
    a projection ``eh_proj`` [h, 2h], one Transformer block, the shared output head):
    ``MTP drafts``, the block as one decoder layer of a plain step of the batch (its kernels
    and, an MoE layer, its dispatch and combine); ``MTP draft head``, the output head over
    the whole vocabulary (FLOPs at the bf16 GEMM rate, the rank's lm_head weights read,
    like the step's own) and ``eh_proj`` (model precision), each a roofline."""
    base = forward_cost(m, plan, prec, hw, replace(opts, mtp=0),
                        Work(batch, 0.0, 0.0, batch, True))
    block = sum(base.phase_s(p) for p in (PRE, ATTN, SHARED, MOE)) / m.num_hidden_layers
    if m.n_routed_experts:
        block += (base.phase_s(DISPATCH) + base.phase_s(COMBINE)) / num_moe_layers(m)
    h, tp = m.hidden_size, plan.layout.tp
    lm_bytes = sum(r.bytes for r in plan.rows if r.kind == "lm_head")
    flops = 2 * batch * h * (m.vocab_size / tp + 2 * h)
    head = roofline("MTP draft head", SERIAL, flops,
                     hw.spec.bf16_tflops * TFLOPS * hw.spec.kernels.gemm_bf16,
                     lm_bytes + 2 * h * h * prec.weight, hw.hbm())
    return (Term("MTP drafts", SERIAL, opts.mtp * block, "compute"),
            replace(head, seconds=opts.mtp * head.seconds))

"""Seconds of one prefill, one decode step and one KV transfer, term by term.

A forward pass of ``tokens`` tokens on one DP rank is a list of :class:`Term`:

- kernels, each its roofline ``max(FLOPs / (peak x kernel efficiency), bytes / (HBM x
  efficiency))``: before the attention core (MLA / indexer / dense-MLP linears at the
  linears' GEMM precision, the kernels between them), the attention core with the output
  projection, router gate and lm_head, the shared experts, the routed experts x the
  expert-load imbalance (and the kernels between them), split over the DP rank's
  ``tp x cp`` ranks;
- the EP all-to-all dispatch and combine (:mod:`.moe`);
- serial terms: TP all-reduces (ring: ``2 (n-1)/n`` of the bytes) and the vocab-parallel
  collectives, context-parallel gathers, prefill's SP-TP-SP collectives, host dispatch,
  the step call, serving cost, the MTP draft module (its block and its output head).

Without overlap the step is the sum. With two micro-batches (:class:`.moe.StepOptions`) each
kernel runs twice on half the tokens (weights read twice), compute-bound kernels under the
prefill all-to-all lose the share of compute units its kernels hold, and the phases add up
as DeepSeek's prefill or decode schedule pairs them with the other micro-batch's
all-to-all (:mod:`.overlap`). The linears run at the 8-bit peak when they are stored in one byte
(FP8 where the device has it, else INT8), else at the bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model_config import ModelConfig
from engine.v4.config import V4Config
from orchestrator.config.memory_plan import Precision, RolePlan
from orchestrator.config.role_layout import RoleLayout
from orchestrator.config.weight_rows import num_moe_layers
from orchestrator.config.memory_plan_v4 import V4Precision
from orchestrator.planner import counts, counts_v4
from orchestrator.planner.moe import (StepOptions, alltoall_s, experts_per_rank, imbalance,
                                      receive_excess)
from orchestrator.planner.overlap import (ATTN, COMBINE, DECODE, DISPATCH, MOE, NONE, PRE,
                                          PREFILL, SERIAL, SHARED, Phases, step_s)
from orchestrator.planner.specs import DeviceSpec

GBPS = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Term:
    """One cause of time: ``phase`` places it in a step; ``bound`` says what limits it
    ("compute", "memory", "link", "host")."""

    name: str
    phase: str
    seconds: float
    bound: str


@dataclass(frozen=True)
class Cost:
    """Seconds by cause (module docstring); ``total_s`` per the overlap schedule.

    Attributes:
        terms: the terms, by name (one per name).
        schedule: how the phases add up (:mod:`.overlap`: none, prefill, decode).
        tokens_per_step: tokens a sequence gains per step (MTP: 1 + accepted drafts).
        imbalance: busiest EP rank's routed tokens over the mean.
    """

    terms: tuple[Term, ...]
    schedule: str = NONE
    tokens_per_step: float = 1.0
    imbalance: float = 1.0

    def phase_s(self, phase: str) -> float:
        return sum(t.seconds for t in self.terms if t.phase == phase)

    def bound_s(self, bound: str) -> float:
        return sum(t.seconds for t in self.terms if t.bound == bound)

    @property
    def overlap(self) -> bool:
        """Two micro-batches."""
        return self.schedule != NONE

    @property
    def phases(self) -> Phases:
        return Phases(*(self.phase_s(p) for p in (PRE, ATTN, SHARED, MOE, DISPATCH, COMBINE,
                                                  SERIAL)))

    @property
    def total_s(self) -> float:
        return step_s(self.phases, self.schedule)

    @property
    def compute_s(self) -> float:
        return self.bound_s("compute")

    @property
    def memory_s(self) -> float:
        return self.bound_s("memory")

    @property
    def comm_s(self) -> float:
        return self.bound_s("link")

    @property
    def overhead_s(self) -> float:
        return self.bound_s("host")

    def __add__(self, other: "Cost") -> "Cost":
        names = {t.name: t for t in self.terms}
        for t in other.terms:
            old = names.get(t.name)
            names[t.name] = t if old is None else replace(old, seconds=old.seconds + t.seconds)
        return replace(self, terms=tuple(names.values()))


@dataclass(frozen=True)
class Hardware:
    """A device with its kernel efficiencies applied: achieved rates in bytes/s, FLOP/s."""

    spec: DeviceSpec

    def gemm_flops(self, prec: Precision) -> float:
        """FLOP/s of the linears: 1-byte weights at the FP8 peak (else INT8: W8A8), else the
        bf16 peak (cpu: the measured rate at the model dtype)."""
        s, k = self.spec, self.spec.kernels
        if eight_bit(prec):
            if s.fp8_tflops > 0:
                return s.fp8_tflops * TFLOPS * k.gemm_fp8
            return s.int8_tflops * TFLOPS * k.gemm_int8
        return s.bf16_tflops * TFLOPS * k.gemm_bf16

    def attn_flops(self, decode: bool, mha_keys: float = 0.0) -> float:
        """FLOP/s of attention: decode's kernel, else prefill's; a causal prefill in MHA
        form whose queries see ``mha_keys`` keys on average (> 0) at the device's causal
        figure for sequences of ``2 x mha_keys`` tokens (a causal sequence of L tokens:
        (L + 1) / 2 keys a query on average)."""
        k = self.spec.kernels
        if decode:
            eff = k.attn_decode
        else:
            eff = k.causal_prefill(2 * mha_keys) if mha_keys > 0 else k.attn_prefill
        return self.spec.bf16_tflops * TFLOPS * eff

    def hbm(self, kind: str = "weights_hbm") -> float:
        return self.spec.hbm_gb_s * GBPS * getattr(self.spec.kernels, kind)

    @property
    def latency_s(self) -> float:
        return self.spec.link_latency_us * 1e-6

    def link(self, group: int) -> float:
        """Bytes/s per rank of a collective over ``group`` ranks (the inter-domain link once
        it spans more than one scale-up domain)."""
        gb_s = self.spec.intra_domain_gb_s if group <= self.spec.domain_ranks \
            else self.spec.inter_domain_gb_s
        return gb_s * GBPS * self.spec.kernels.link


def counts_for(m: ModelConfig | V4Config):
    """The per-token counts of ``m``'s family: :mod:`.counts_v4` for DeepSeek-V4, else
    :mod:`.counts` (same function names and units)."""
    return counts_v4 if isinstance(m, V4Config) else counts


def expert_bytes_per_el(prec: Precision) -> float:
    """Bytes per routed-expert weight: DeepSeek-V4's own (FP4 in the release), else the
    linears'."""
    return prec.expert if isinstance(prec, V4Precision) else prec.linear


def eight_bit(prec: Precision) -> bool:
    """Linears stored in one byte (FP8 / INT8; their block scales add a few bytes per
    thousand weights: ~1.0002 bytes per weight, :func:`engine.quant.memory.bytes_per_param`)."""
    return prec.linear < 1.5


def _roofline(name: str, phase: str, flops: float, rate: float, nbytes: float,
              bw: float) -> Term:
    c, m = flops / rate, nbytes / bw
    return Term(name, phase, max(c, m), "compute" if c >= m else "memory")


def allreduce_s(hw: Hardware, nbytes: float, n: int) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / hw.link(n) + hw.latency_s


def overlap_on(lay: RoleLayout, hw: Hardware, opts: StepOptions) -> bool:
    """The option, else on for an EP layout on an accelerator (SGLang / DeepSeek large EP
    run two micro-batches; orch's cpu engine does not)."""
    if opts.overlap is not None:
        return opts.overlap
    return lay.ep and lay.ep_size > 1 and hw.spec.platform != "cpu"


@dataclass(frozen=True)
class Work:
    """What one forward pass of a DP rank does: ``tokens`` through the linears,
    ``attn_flops`` attention-core FLOPs reading ``kv_bytes``, ``lm_rows`` rows through
    lm_head; ``decode``: decode kernels (attention efficiency, low-latency all-to-all);
    ``prefix_flops``: prefill's re-expansion of the prefix latents to per-head K/V
    (:func:`.counts.prefix_up_flops`), at the linears' rate; ``mha_keys``: a prefill in
    MHA form (causal, per-head keys): the keys a query sees on average, which sets the
    attention kernel's rate (:meth:`Hardware.attn_flops`; 0: absorbed / sparse form)."""

    tokens: float
    attn_flops: float
    kv_bytes: float
    lm_rows: float
    decode: bool
    prefix_flops: float = 0.0
    mha_keys: float = 0.0

    def half(self) -> "Work":
        """One of two micro-batches: half the tokens of the same prompts (the keys a query
        sees unchanged)."""
        return Work(self.tokens / 2, self.attn_flops / 2, self.kv_bytes / 2,
                    self.lm_rows / 2, self.decode, self.prefix_flops / 2, self.mha_keys)


def _kernels(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
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
    terms = [_roofline("linears", PRE, dense_flops * (1 - out_share) + w.prefix_flops / ranks,
                       gemm,
                       dense_bytes * (1 - out_share), hbm),
             _roofline("output linears", ATTN, dense_flops * out_share, gemm,
                       dense_bytes * out_share, hbm),
             _roofline("attention", ATTN, w.attn_flops / ranks,
                       hw.attn_flops(w.decode, w.mha_keys), w.kv_bytes,
                       hw.hbm("attn_decode_hbm"))]
    if lm_flops:
        terms.append(Term("lm_head", ATTN, lm_flops / lm_rate, "compute"))
    if not m.n_routed_experts:
        return terms, 1.0
    group_tokens = w.tokens * (lay.dp if lay.ep else 1)
    imb = imbalance(m, lay.ep_size, group_tokens, opts) if lay.ep else 1.0
    terms.append(_roofline("shared experts", SHARED,
                           2 * w.tokens * c.shared_params_per_token(m) / ranks, gemm,
                           rows.get("shared experts", 0), hbm))
    active = c.expert_active_share(m, group_tokens)
    if lay.ep:
        held = experts_per_rank(m, lay.ep_size, opts.redundant)
        expert_bytes = num_moe_layers(m) * held * c.expert_params(m) * expert_bytes_per_el(prec)
    else:
        expert_bytes = rows.get("routed experts", 0)
    masked = hw.spec.kernels.gemm_masked if w.decode else 1.0
    terms.append(_roofline("routed experts", MOE,
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


def _tp_comm(m: ModelConfig, lay: RoleLayout, hw: Hardware, w: Work, act: float) -> float:
    """TP all-reduces (:func:`.counts.tp_allreduces_per_layer` per layer, one for the
    vocab-parallel embedding) and, decoding, the all-gather of the sampled rows' fp32
    logits."""
    if lay.tp <= 1:
        return 0.0
    hidden = w.tokens / lay.cp * m.hidden_size * act
    per_layer = counts_for(m).tp_allreduces_per_layer(lay.ep)
    seconds = (per_layer * m.num_hidden_layers + 1) * allreduce_s(hw, hidden, lay.tp)
    if w.decode:
        gather = w.lm_rows * m.vocab_size * 4 * (lay.tp - 1) / lay.tp
        seconds += gather / hw.link(lay.tp) + hw.latency_s
    return seconds


def sp_tp_s(m: ModelConfig, hw: Hardware, tokens: float, n: int, act: float,
            batches: int = 1) -> float:
    """Prefill's SP-TP-SP collectives (:func:`.counts.sp_tp_bytes`) over ``n`` ranks for
    ``tokens`` tokens per rank in ``batches`` micro-batches, s: per layer the gather and the
    all-to-all at the collective link rate plus a latency each per micro-batch. Taken as
    serial: the source overlaps the MoE all-to-all with the other micro-batch, and does not
    say these are (an assumption, docs/planner.md)."""
    c = counts_for(m)
    gathered, a2a = c.sp_tp_bytes(m, tokens, n, act)
    return m.num_hidden_layers * ((gathered + a2a) / hw.link(n) + 2 * batches * hw.latency_s)


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
    kernels, imb = _kernels(m, plan, prec, hw, opts, part)
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
    terms += [Term("TP collectives", SERIAL, _tp_comm(m, lay, hw, w, prec.activation), "link"),
              Term("host", SERIAL, host_s(m, lay, hw, w.tokens) + step_call_s(lay, hw)
                   + serving_s(hw), "host")]
    schedule = NONE if n == 1 else (DECODE if w.decode else PREFILL)
    return Cost(tuple(terms), schedule, 1.0, imb)


def host_s(m: ModelConfig, lay: RoleLayout, hw: Hardware, tokens: float) -> float:
    """Host dispatch of one step of ``tokens`` tokens on one DP rank (with ``ep`` every DP
    rank's tokens reach the experts): per layer, plus per routed expert the rank runs."""
    c = counts_for(m)
    step_tokens = tokens * (lay.dp if lay.ep else 1)
    local = (m.n_routed_experts or 0) / lay.ep_size
    experts = num_moe_layers(m) * local * c.expert_active_share(m, step_tokens)
    return 1e-6 * (m.num_hidden_layers * hw.spec.layer_overhead_us
                   + experts * hw.spec.expert_overhead_us)


def step_call_s(lay: RoleLayout, hw: Hardware) -> float:
    """The leader's Ray call that runs a step on its TP followers (0 for tp 1)."""
    return hw.spec.control_call_us * 1e-6 if lay.tp > 1 else 0.0


def serving_s(hw: Hardware) -> float:
    """The serving layer's cost of one leader step beyond the engine's (scheduler, sampler,
    token events and the router's poll of them), s."""
    return hw.spec.step_serving_us * 1e-6


def request_calls(colocated: bool) -> int:
    """Ray calls in turn on a request's way to its first token (docs/request_path.md):
    colocated, the launch; disaggregated, the decode reservation, the receivers it arms on
    the decode ranks (in parallel: one round trip) and the prefill launch."""
    return 1 if colocated else 3


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
        computed = prompt - cached
        chunks = -(-computed // chunk)
        gather = (lay.cp - 1) / lay.cp * computed * c.kv_bytes_per_token(m, prec) \
            / hw.link(lay.ranks) + m.num_hidden_layers * hw.latency_s * chunks
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
    head = _roofline("MTP draft head", SERIAL, flops,
                     hw.spec.bf16_tflops * TFLOPS * hw.spec.kernels.gemm_bf16,
                     lm_bytes + 2 * h * h * prec.weight, hw.hbm())
    return (Term("MTP drafts", SERIAL, opts.mtp * block, "compute"),
            replace(head, seconds=opts.mtp * head.seconds))


def kv_transfer_cost(m: ModelConfig, prec: Precision, hw: Hardware, prompt: int,
                     group: int) -> Cost:
    """Shipping ``prompt`` tokens' KV (what decode does not hold already) to a decode DP
    rank: every decode rank receives all of it over its link (inter-domain once the
    ``group`` of both roles' ranks spans domains), one message per layer."""
    c = counts_for(m)
    nbytes = c.kv_bytes_per_request(m, prec, prompt)
    return Cost((Term("KV transfer", SERIAL,
                      nbytes / hw.link(group) + m.num_hidden_layers * hw.latency_s, "link"),))

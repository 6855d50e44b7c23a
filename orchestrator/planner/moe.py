"""The MoE terms of a step: experts per rank (with redundant copies), expert-load imbalance,
and the EP all-to-all as the EP libraries move it.

- Experts per rank: ``ceil((n_routed_experts + redundant) / ep)``; ``redundant`` defaults to
  the fewest copies that make the EP size divide the slots (DeepSeek's 256 + 32 on EP 144),
  so an EP size need not divide the expert count.
- Imbalance (max / mean routed tokens per rank): each rank's load is ``mean`` routed copies
  with a relative spread ``sqrt(1 / mean + r^2)``: the batch's sampling noise and what the
  placement leaves. With ``eplb`` off ``r^2 = skew^2 / experts_per_rank`` (the experts'
  popularity, ``skew`` its coefficient of variation); with EPLB on ``r = drift``, the
  per-rank spread EPLB leaves on real routing (the batch's routing drifts from the
  statistics it placed by; :data:`EPLB_DRIFT`, 0 for simulated perfect balance). The busiest
  of ``ep`` ranks sits ``z(ep)`` spreads above the mean, the expected maximum of ``ep``
  standard normal draws (Blom's approximation, :func:`expected_max`).
- All-to-all per MoE layer and rank, ``T`` tokens on the rank, ``k`` routed experts each,
  dispatch in 8-bit (+ a 4-byte scale per 128 values) when the linears are 8-bit, combine in
  bf16. Prefill ("normal" kernels): a token goes once to each distinct destination domain
  (``n (1 - (1 - 1/n)^k)`` of ``n`` domains) over the inter-domain link, then inside the
  domain once per distinct rank; the slower of the two paths counts. Decode ("low-latency"
  kernels): one copy per routed expert at the EP size's measured bandwidth. Either takes at
  least the link latency. Without the library's figures (cpu): every copy over the plain
  links. What reaches the busiest rank (decode's copies, prefill's forwarding inside a
  domain) is scaled by its load's excess over the uniform routing the figures were measured
  on (:func:`receive_excess`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from engine.model_config import ModelConfig
from orchestrator.config.weight_rows import num_moe_layers
from orchestrator.planner.specs import AllToAll, DeviceSpec

GBPS = 1e9
SCALE_BYTES = 4 / 128  # one fp32 scale per 128 8-bit values (DeepEP / DeepGEMM FP8 blocks)
# The per-rank relative spread of routed tokens EPLB leaves on real routing, the sampling
# noise taken out. TensorRT-LLM tech blog 4 ("Scaling Expert Parallelism in TensorRT-LLM,
# Part 1", Table 1; github.com/NVIDIA/TensorRT-LLM docs/source/blogs/tech_blog): DeepSeek-R1
# on EP32 with 288 slots (9 a rank), offline EPLB placed from the same dataset's statistics,
# routed tokens per rank averaged over layers and iterations: mean 1024, imbalance ratio
# (max - mean) / mean 0.109, standard deviation 52.0 (without EPLB: 1.564, 491.6). Solved
# so that :func:`imbalance` gives that max / mean at that setting: 0.109 = z(32) x
# sqrt(1 / 1024 + drift^2), z(32) = 2.067 -> 0.0425. (From the standard deviation instead:
# sqrt((52.0 / 1024)^2 - 1 / 1024) = 0.040; its EP36 / 8-slot row: 0.0445 from the ratio
# 0.115.) A routed-token statistic of a kernel-level trace, not a throughput.
EPLB_DRIFT = 0.0425


@dataclass(frozen=True)
class StepOptions:
    """How the engine runs a step (``--workload`` keys; docs/planner.md).

    Attributes:
        overlap: two micro-batches, communication under computation (None: on where the
            engines do it: an EP layout on an accelerator).
        mtp: draft tokens per step (multi-token prediction); 0 off.
        accept: probability each draft is accepted (chained: draft i needs drafts < i).
        eplb: expert-parallel load balancer on (replicas placed to even the expected loads).
        skew: coefficient of variation of the experts' popularity (used with eplb off).
        drift: per-rank relative spread of routed tokens EPLB leaves (used with eplb on;
            :data:`EPLB_DRIFT`; 0: simulated perfect balance, uniform routing).
        redundant: redundant expert slots (None: the fewest that make the EP size divide).
        attn_tp: prefill's attention core by heads over this many ranks of the DP group,
            the rest sequence-parallel (CloudMatrix-Infer's SP-TP-SP); 1: each rank its own
            prompts (DP attention).
    """

    overlap: bool | None = None
    mtp: int = 0
    accept: float = 0.0
    eplb: bool = True
    skew: float = 0.5
    drift: float = EPLB_DRIFT
    redundant: int | None = None
    attn_tp: int = 1

    def tokens_per_step(self) -> float:
        """Tokens a sequence gains per decode step: 1 + expected accepted drafts."""
        return 1.0 + sum(self.accept ** i for i in range(1, self.mtp + 1))


def experts_per_rank(m: ModelConfig, ep: int, redundant: int | None = None) -> int:
    """Routed expert slots one rank holds at EP size ``ep`` (all experts for ep 1)."""
    experts = m.n_routed_experts or 0
    if ep <= 1 or not experts:
        return experts
    slots = experts + (redundant if redundant is not None else -experts % ep)
    return -(-slots // ep)


def imbalance(m: ModelConfig, ep: int, tokens: float, opts: StepOptions) -> float:
    """Busiest rank's routed tokens over the mean, for ``tokens`` tokens over the whole EP
    group in one step (module docstring)."""
    if ep <= 1 or not m.n_routed_experts or tokens <= 0:
        return 1.0
    mean = tokens * m.num_experts_per_tok / ep
    var = 1.0 / mean + (opts.drift ** 2 if opts.eplb else opts.skew ** 2
                        / experts_per_rank(m, ep, opts.redundant))
    return 1.0 + expected_max(ep) * math.sqrt(var)


def expected_max(n: int) -> float:
    """Expected maximum of ``n`` independent standard normal draws, Blom's approximation
    ``Phi^-1((n - 0.375) / (n + 0.25))`` (Blom 1958; exact values 0.564 for n = 2, 1.539
    for 10, 2.508 for 100: within 5 % at n = 2, 1 % from n = 5). 0 for n = 1. (The bound
    ``sqrt(2 ln n)`` is 2.63 at n = 32 against 2.07; TensorRT-LLM's EP32 figures above give
    (max - mean) / std = 0.109 x 1024 / 52.0 = 2.15: the expected maximum, not the bound.)"""
    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25)) if n > 1 else 0.0


def receive_excess(m: ModelConfig, ep: int, tokens: float, opts: StepOptions,
                   measured: bool) -> float:
    """The busiest rank's share of an all-to-all over the mean, beyond what the bandwidth
    figures hold: the rank that receives the most routed copies (and sends them back in the
    combine) finishes last. The EP library's figures (``measured``) were taken on uniform
    random routing (DeepEP tests/test_low_latency.py and test_internode.py: top-k of
    ``|randn| + 1`` scores over all experts; bandwidth = the rank's bytes / kernel time), so
    that routing's own sampling noise is in them: the excess is :func:`imbalance` over its
    value at ``drift`` 0 (EPLB on). Plain links (no figures): the whole imbalance."""
    imb = imbalance(m, ep, tokens, opts)
    if not measured:
        return imb
    return imb / imbalance(m, ep, tokens, StepOptions(eplb=True, drift=0.0))


def distinct(n: int, k: int) -> float:
    """Expected distinct bins among ``k`` uniform picks of ``n`` bins."""
    return n * (1 - (1 - 1 / n) ** k) if n > 0 else 0.0


@dataclass(frozen=True)
class Links:
    """What the all-to-all needs of a device: achieved GB/s and the latency floor."""

    intra_gb_s: float
    inter_gb_s: float
    domain_ranks: int
    latency_s: float


def alltoall_s(m: ModelConfig, spec: DeviceSpec, tokens: float, ep: int, decode: bool,
               eight_bit: bool, link_eff: float, excess: float = 1.0) -> tuple[float, float]:
    """(dispatch, combine) seconds of one step's all-to-alls over every MoE layer, for
    ``tokens`` tokens on one rank at EP size ``ep`` (``link_eff``: of the plain links, when
    ``spec`` has no library figures; ``excess``: :func:`receive_excess`, on what reaches a
    rank: decode's copies, prefill's forwarding inside a domain and plain links; prefill's
    inter-domain path carries a domain's load, the sum of its ranks', taken as balanced:
    EPLB's hierarchical policy balances nodes first, and 8 ranks' spreads average out)."""
    if ep <= 1 or not m.n_routed_experts or tokens <= 0:
        return 0.0, 0.0
    h, k = m.hidden_size, m.num_experts_per_tok
    sizes = (h * (1 + SCALE_BYTES) if eight_bit else 2 * h, 2 * h)
    floor = spec.link_latency_us * 1e-6
    a2a = spec.alltoall
    if a2a is None:
        plain = Links(spec.intra_domain_gb_s * link_eff, spec.inter_domain_gb_s * link_eff,
                      spec.domain_ranks, floor)
        per = _plain(tokens * k * excess, sizes, ep, plain)
    elif decode:
        bw = a2a.low_latency_gb_s(ep)
        per = tuple(max(floor, tokens * k * excess * b / (g * GBPS))
                    for b, g in zip(sizes, bw))
    else:
        per = _normal(m, tokens, sizes, ep, spec.domain_ranks, a2a, floor, excess)
    layers = num_moe_layers(m)
    return per[0] * layers, per[1] * layers


def _plain(copies: float, sizes: tuple[float, float], ep: int,
           links: Links) -> tuple[float, float]:
    """Every copy sent as is: the off-domain share over the inter-domain link, the rest
    inside, in parallel."""
    away = copies * (ep - 1) / ep
    off = max(0.0, 1 - links.domain_ranks / ep)
    return tuple(max(away * (1 - off) * b / (links.intra_gb_s * GBPS),
                     away * off * b / (links.inter_gb_s * GBPS)) + links.latency_s
                 for b in sizes)


def _normal(m: ModelConfig, tokens: float, sizes: tuple[float, float], ep: int, domain: int,
            a2a: AllToAll, floor: float, excess: float) -> tuple[float, float]:
    """Prefill kernels: once per distinct destination domain across, once per distinct
    rank inside (what reaches the busiest rank: x ``excess``)."""
    k = m.num_experts_per_tok
    domains = -(-ep // domain)
    inside = min(ep, domain)
    intra_copies = tokens * distinct(inside, k) * (inside - 1) / inside
    out = []
    for i, b in enumerate(sizes):
        t = intra_copies * excess * b / (a2a.normal_intra[i] * GBPS)
        if domains > 1:
            remote = tokens * distinct(domains, k) * (domains - 1) / domains
            t = max(t, remote * b / (a2a.normal_inter[i] * GBPS))
        out.append(max(floor, t))
    return out[0], out[1]

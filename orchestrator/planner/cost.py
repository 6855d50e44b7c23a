"""Seconds of one prefill, one decode step and one KV transfer, from FLOPs and bytes.

Every time is a :class:`Cost`: compute and memory overlap (the larger counts), collectives
and host dispatch add. Counts follow the engine's layout (docs/planner.md):

- linear FLOPs: 2 x the parameters a token touches (MLA projections on all heads, dense MLP
  or shared + ``num_experts_per_tok`` routed experts, router gate, V3.2 indexer), split over
  the ``tp x cp`` ranks of a DP rank;
- attention FLOPs: dense MLA in MHA form over the causal prefix (prefill) or absorbed over
  the whole context (decode); V3.2 sparse attention over ``min(context, index_topk)`` keys in
  absorbed form plus the indexer's ``index_n_heads x index_head_dim`` dot products over the
  whole prefix;
- bytes: the memory plan's weights (routed experts only the share a step activates) and the
  KV read by attention;
- collectives: two TP all-reduces per layer (ring: ``2 (n-1)/n`` of the bytes) and one for
  the vocab-parallel embedding, the all-gather of the sampled rows' fp32 logits, and with
  ``ep`` an all-to-all dispatch and combine per MoE layer; each also pays the link latency.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_config import ModelConfig
from engine.quant.formats import W8A8_INT8
from orchestrator.config.memory_plan import Precision, RoleLayout, RolePlan, num_moe_layers
from orchestrator.planner.specs import DeviceSpec, Efficiency

GBPS = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Cost:
    """Seconds by cause; ``total_s`` = max(compute, memory) + comm + overhead."""

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s


@dataclass(frozen=True)
class Hardware:
    """A device with its efficiency factors applied: achieved rates in bytes/s and FLOP/s."""

    spec: DeviceSpec
    eff: Efficiency

    @property
    def flops(self) -> float:
        return self.spec.bf16_tflops * TFLOPS * self.eff.compute

    def linear_flops(self, m: ModelConfig) -> float:
        """FLOP/s of the decoder's linears: the int8 peak for a W8A8 checkpoint (int8
        activations and weights), else bf16 (FP8 weights are dequantized to compute)."""
        int8 = m.quantization is not None and m.quantization.method == W8A8_INT8
        return (self.spec.int8_tflops if int8 else self.spec.bf16_tflops) * TFLOPS \
            * self.eff.compute

    @property
    def hbm(self) -> float:
        return self.spec.hbm_gb_s * GBPS * self.eff.hbm

    @property
    def latency_s(self) -> float:
        return self.spec.link_latency_us * 1e-6

    def link(self, group: int) -> float:
        """Bytes/s per rank of a collective over ``group`` ranks (inter-node once it spans
        more than one node)."""
        gb_s = self.spec.intra_node_gb_s if group <= self.spec.ranks_per_node \
            else self.spec.inter_node_gb_s
        return gb_s * GBPS * self.eff.link


def linear_params_per_token(m: ModelConfig) -> int:
    """Weights one token multiplies with over all decoder layers (lm_head not included)."""
    heads, h = m.num_attention_heads, m.hidden_size
    q = (h * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim) if m.q_lora_rank \
        else h * heads * m.qk_head_dim
    attn = q + h * (m.kv_lora_rank + m.qk_rope_head_dim) \
        + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h
    indexer = m.q_lora_rank * m.index_n_heads * m.index_head_dim \
        + h * (m.index_head_dim + m.index_n_heads) if m.uses_sparse_attention else 0
    moe = num_moe_layers(m)
    experts = m.n_routed_experts or 0
    per_moe = 3 * h * m.moe_intermediate_size * (m.n_shared_experts + m.num_experts_per_tok) \
        + experts * h
    dense = 3 * h * m.intermediate_size
    return m.num_hidden_layers * attn + sum(m.indexer_layers) * indexer + moe * per_moe \
        + (m.num_hidden_layers - moe) * dense


def attention_flops(m: ModelConfig, new: int, past: int) -> float:
    """FLOPs of attention (all layers, all heads) for ``new`` tokens after ``past`` cached
    ones, causal."""
    heads, layers = m.num_attention_heads, m.num_hidden_layers
    # sum over the new tokens of the keys each sees: past + 1 .. past + new
    keys = new * past + new * (new + 1) / 2
    if not m.uses_sparse_attention:
        per_key = (m.qk_head_dim + m.v_head_dim) if new > 1 else \
            (2 * m.kv_lora_rank + m.qk_rope_head_dim)  # decode runs absorbed MLA
        return 2.0 * layers * heads * per_key * keys
    k = m.index_topk
    capped = sum_min(past, new, k)
    absorbed = 2 * m.kv_lora_rank + m.qk_rope_head_dim
    # NOTE: only indexer layers score (GLM-5.2's shared ones reuse a selection)
    return 2.0 * (layers * heads * absorbed * capped
                  + sum(m.indexer_layers) * m.index_n_heads * m.index_head_dim * keys)


def sum_min(past: int, new: int, k: int) -> float:
    """sum over t in past+1 .. past+new of min(t, k)."""
    lo, hi = past + 1, past + new
    a_hi, b_lo = min(hi, k), max(lo, k + 1)
    below = (a_hi - lo + 1) * (lo + a_hi) / 2 if lo <= a_hi else 0.0
    return below + (hi - b_lo + 1) * k if b_lo <= hi else below


def kv_bytes_per_token(m: ModelConfig, prec: Precision) -> float:
    """KV cache bytes of one token over all layers (latent, k_pe, DSA index_k on the indexer
    layers)."""
    return (m.num_hidden_layers * (m.kv_lora_rank + m.qk_rope_head_dim)
            + sum(m.indexer_layers) * m.index_head_dim) * prec.kv


def allreduce_s(hw: Hardware, nbytes: float, n: int) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / hw.link(n) + hw.latency_s


def all_to_all_s(hw: Hardware, nbytes: float, n: int) -> float:
    """One all-to-all where each rank sends ``nbytes`` spread over ``n`` ranks: the off-node
    share over the inter-node link, the rest over intra-node links, in parallel."""
    if n <= 1:
        return 0.0
    away = nbytes * (n - 1) / n
    rpn = hw.spec.ranks_per_node
    off = max(0.0, 1 - rpn / n)
    intra = hw.spec.intra_node_gb_s * GBPS * hw.eff.link
    inter = hw.spec.inter_node_gb_s * GBPS * hw.eff.link
    return max(away * (1 - off) / intra, away * off / inter) + hw.latency_s


def _comm_per_layer(m: ModelConfig, lay: RoleLayout, hw: Hardware, tokens: float,
                    act: float) -> float:
    """Collectives of one pass of ``tokens`` tokens through every layer of one DP rank: the
    TP all-reduces on each CP rank's ``tokens / cp``, the EP all-to-alls on each rank's
    ``tokens / (tp cp)``."""
    hidden = tokens / lay.cp * m.hidden_size * act
    ar = 2 * m.num_hidden_layers * allreduce_s(hw, hidden, lay.tp)
    if not lay.ep:
        return ar
    per_rank = tokens / (lay.tp * lay.cp) * m.num_experts_per_tok * m.hidden_size * act
    return ar + 2 * num_moe_layers(m) * all_to_all_s(hw, per_rank, lay.ep_size)


def _vocab_comm(m: ModelConfig, lay: RoleLayout, hw: Hardware, tokens: float,
                act: float) -> float:
    """The vocab-parallel embedding's all-reduce (``tokens`` rows) and the all-gather of the
    fp32 logits of ``tokens`` sampled rows (each rank receives the other ranks' vocab
    shares)."""
    if lay.tp <= 1:
        return 0.0
    gather = tokens * m.vocab_size * 4 * (lay.tp - 1) / lay.tp
    return allreduce_s(hw, tokens * m.hidden_size * act, lay.tp) \
        + gather / hw.link(lay.tp) + hw.latency_s


def prefill_cost(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
                 prompt: int, chunk: int) -> Cost:
    """One prompt of ``prompt`` tokens on one prefill DP rank, in chunks of ``chunk`` tokens.

    With ``cp`` (context parallel, seed 004's DSA-CP) each of the DP rank's ``cp`` ranks
    computes ``1 / cp`` of the tokens with all heads and the K/V latents of each chunk are
    all-gathered; layer-sharded weights' broadcasts are taken as hidden behind compute.
    """
    lay = plan.layout
    ranks = lay.tp * lay.cp
    seconds = (2.0 * prompt * linear_params_per_token(m) / hw.linear_flops(m)
               + attention_flops(m, prompt, 0) / hw.flops) / ranks
    chunks = -(-prompt // chunk)
    memory = chunks * plan.bytes_of("weights") / hw.hbm
    comm = _comm_per_layer(m, lay, hw, prompt, prec.activation) \
        + allreduce_s(hw, prompt / lay.cp * m.hidden_size * prec.activation, lay.tp)
    if lay.cp > 1:
        comm += (lay.cp - 1) / lay.cp * prompt * kv_bytes_per_token(m, prec) / hw.link(ranks) \
            + m.num_hidden_layers * hw.latency_s * chunks
    overhead = chunks * (host_s(m, lay, hw, min(chunk, prompt)) + step_call_s(lay, hw)
                         + serving_s(hw))
    return Cost(seconds, memory, comm, overhead)


def expert_active_share(m: ModelConfig, tokens: float) -> float:
    """Expected share of routed experts at least one of ``tokens`` tokens picks."""
    experts = m.n_routed_experts or 0
    if not experts:
        return 0.0
    return 1 - (1 - m.num_experts_per_tok / experts) ** tokens


def host_s(m: ModelConfig, lay: RoleLayout, hw: Hardware, tokens: float) -> float:
    """Host dispatch of one step of ``tokens`` tokens on one DP rank (with ``ep`` every DP
    rank's tokens reach the experts): per layer, plus per routed expert the rank runs."""
    step_tokens = tokens * (lay.dp if lay.ep else 1)
    local = (m.n_routed_experts or 0) / lay.ep_size
    experts = num_moe_layers(m) * local * expert_active_share(m, step_tokens)
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


def decode_step_cost(m: ModelConfig, plan: RolePlan, prec: Precision, hw: Hardware,
                     batch: float, context: float) -> Cost:
    """One decode step of ``batch`` sequences of ``context`` tokens on one decode DP rank
    (with ``ep`` every DP rank steps together with the same batch)."""
    lay = plan.layout
    step_tokens = batch * (lay.dp if lay.ep else 1)
    rows = {r.kind: r.bytes for r in plan.rows}
    weights = plan.bytes_of("weights") - rows.get("embedding", 0) \
        - rows.get("routed experts", 0) * (1 - expert_active_share(m, step_tokens))
    per_seq_kv = prec.kv * (
        m.num_hidden_layers * min(context, m.index_topk) * (m.kv_lora_rank + m.qk_rope_head_dim)
        + sum(m.indexer_layers) * context * m.index_head_dim if m.uses_sparse_attention
        else m.num_hidden_layers * context * (m.kv_lora_rank + m.qk_rope_head_dim))
    seconds = batch * (2.0 * linear_params_per_token(m) / hw.linear_flops(m)
                       + (2.0 * m.hidden_size * m.vocab_size
                          + attention_flops(m, 1, int(context))) / hw.flops) / lay.tp
    comm = _comm_per_layer(m, lay, hw, batch, prec.activation) + _vocab_comm(m, lay, hw, batch,
                                                                              prec.activation)
    return Cost(seconds, (weights + batch * per_seq_kv) / hw.hbm, comm,
                host_s(m, lay, hw, batch) + step_call_s(lay, hw) + serving_s(hw))


def kv_transfer_cost(m: ModelConfig, prec: Precision, hw: Hardware, prompt: int,
                     group: int) -> Cost:
    """Shipping one prompt's KV to a decode DP rank: every decode rank receives all of it
    over its link (inter-node once the ``group`` of both roles' ranks spans nodes), one
    message per layer."""
    nbytes = prompt * kv_bytes_per_token(m, prec)
    return Cost(0.0, 0.0, nbytes / hw.link(group) + m.num_hidden_layers * hw.latency_s, 0.0)

"""The communication terms of a step, s: TP all-reduces (ring: ``2 (n-1)/n`` of the bytes)
and the vocab-parallel collectives, prefill's SP-TP-SP collectives, context-parallel gathers,
and the KV transfer of a request to decode. The EP all-to-all is :mod:`.moe`'s.
"""

from __future__ import annotations

from engine.model_config import ModelConfig
from orchestrator.config.memory_plan import Precision
from orchestrator.config.role_layout import RoleLayout
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.overlap import SERIAL
from orchestrator.planner.terms import Cost, Term, Work, counts_for


def allreduce_s(hw: Hardware, nbytes: float, n: int) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / hw.link(n) + hw.latency_s


def tp_collectives_s(m: ModelConfig, lay: RoleLayout, hw: Hardware, w: Work,
                     act: float) -> float:
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


def cp_gathers_s(m: ModelConfig, lay: RoleLayout, prec: Precision, hw: Hardware,
                 computed: int, chunk: int) -> float:
    """Context-parallel prefill's all-gathers of the K/V latents of ``computed`` tokens in
    chunks of ``chunk`` tokens over the role's ranks, s: the ``(cp - 1) / cp`` of them each
    rank lacks, plus a latency per layer and chunk."""
    c = counts_for(m)
    chunks = -(-computed // chunk)
    return (lay.cp - 1) / lay.cp * computed * c.kv_bytes_per_token(m, prec) \
        / hw.link(lay.ranks) + m.num_hidden_layers * hw.latency_s * chunks


def kv_transfer_cost(m: ModelConfig, prec: Precision, hw: Hardware, prompt: int,
                     group: int) -> Cost:
    """Shipping ``prompt`` tokens' KV (what decode does not hold already) to a decode DP
    rank: every decode rank receives all of it over its link (inter-domain once the
    ``group`` of both roles' ranks spans domains), one message per layer."""
    c = counts_for(m)
    nbytes = c.kv_bytes_per_request(m, prec, prompt)
    return Cost((Term("KV transfer", SERIAL,
                      nbytes / hw.link(group) + m.num_hidden_layers * hw.latency_s, "link"),))

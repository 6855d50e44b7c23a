"""What one token costs in parameters, FLOPs and KV bytes for DeepSeek-V4: the functions of
:mod:`.counts` (same names and units) where V4 differs from V3.

- parameters a token multiplies with: per layer q_a / q_b / kv_proj, the grouped output
  projection, the compressor (and CSA's indexer: its compressor, ``q_b_proj``,
  ``weights_proj``), both mHC maps, the router gate; every layer is MoE (hash-routed ones too)
  with one shared expert and ``num_experts_per_tok`` routed ones of ``moe_intermediate_size``;
- attention FLOPs: shared-KV MQA, ``4 x heads x head_dim`` per (query, key) (QK and PV), each
  query over the window (``min(position, sliding_window)`` raw keys) plus its compressed
  entries: HCA every entry before it (``position / ratio``), CSA the indexer's top
  ``index_topk`` of them, and the indexer's ``2 x index_n_heads x index_head_dim`` per entry
  it scores. Entries are counted as ``position / ratio`` (not its floor): exact at group
  edges, at most one entry per layer high between them;
- KV bytes: from :mod:`engine.v4.kv_spec` (a request's rows at ``n`` tokens, and the rows a
  decode step reads), not ``n`` x a per-token figure: past the window only the compressed
  entries grow.
"""

from __future__ import annotations

from engine.kv_layer_spec import read_bytes
from engine.v4.config import CSA, HCA, SLIDING, V4Config
from engine.v4.kv_spec import layer_specs
from orchestrator.config.memory_plan import Precision
from orchestrator.config.memory_plan_v4 import (attention_layer, compressor_layer, hc_block,
                                                kv_bytes_per_request as _request_bytes,
                                                output_layer)
from orchestrator.planner.counts import expert_active_share, sum_min

__all__ = ["attention_flops", "dense_params_per_token", "elementwise_bytes_per_token",
           "expert_active_share", "expert_params", "kv_bytes_per_request",
           "kv_bytes_per_token", "kv_read_per_seq", "mha_keys", "output_params_per_token",
           "prefix_up_flops", "routed_params_per_token", "shared_params_per_token",
           "sp_tp_bytes", "tp_allreduces_per_layer"]


def _kinds(m: V4Config) -> dict[str, int]:
    """Layers of each kind."""
    return {k: m.layer_types.count(k) for k in (SLIDING, CSA, HCA)}


def dense_params_per_token(m: V4Config) -> int:
    """Weights every token multiplies with outside the experts: attention, grouped output
    projection, compressors / indexers, mHC, router gates (all layers)."""
    per_kind = sum(n * compressor_layer(m, k) for k, n in _kinds(m).items())
    layers = m.num_hidden_layers
    return layers * (attention_layer(m) + output_layer(m, 1) + 2 * hc_block(m)
                     + m.n_routed_experts * m.hidden_size) + per_kind


def output_params_per_token(m: V4Config) -> int:
    """The part after the attention core: grouped output projection and router gates."""
    return m.num_hidden_layers * (output_layer(m, 1) + m.n_routed_experts * m.hidden_size)


def expert_params(m: V4Config) -> int:
    """Weights of one expert (gate, up, down) of one layer."""
    return 3 * m.hidden_size * m.moe_intermediate_size


def shared_params_per_token(m: V4Config) -> int:
    """The shared expert of every layer (transformers sizes it at ``moe_intermediate_size``)."""
    return m.num_hidden_layers * expert_params(m)


def routed_params_per_token(m: V4Config) -> int:
    """The routed experts a token runs, every layer."""
    return m.num_hidden_layers * m.num_experts_per_tok * expert_params(m)


def attention_flops(m: V4Config, new: int, past: int, absorbed: bool | None = None) -> float:
    """FLOPs of attention (all layers, all heads) for ``new`` tokens after ``past`` (module
    docstring; ``absorbed`` is V3's and changes nothing here: K=V is already one head)."""
    per_key = 4.0 * m.num_attention_heads * m.head_dim
    keys = new * past + new * (new + 1) / 2  # sum of positions (1-based) of the new tokens
    window = sum_min(past, new, m.sliding_window)
    rates = dict(m.compress_rates)
    kinds = _kinds(m)
    csa_r, hca_r = rates[CSA], rates[HCA]
    csa_keys = sum_min(past, new, m.index_topk * csa_r) / csa_r  # sum of min(t / 4, topk)
    index = 2.0 * m.index_n_heads * m.index_head_dim * keys / csa_r
    return per_key * (m.num_hidden_layers * window + kinds[CSA] * csa_keys
                      + kinds[HCA] * keys / hca_r) + kinds[CSA] * index


def mha_keys(m: V4Config, new: int, past: int) -> float:
    """0: V4's shared-KV attention has no MHA-form prefill (its prefill attention takes the
    device's ``attn_prefill``)."""
    return 0.0


def prefix_up_flops(m: V4Config, past: int) -> float:
    """0: V4 keeps K=V as it attends (no latent to expand)."""
    return 0.0


def sp_tp_bytes(m: V4Config, tokens: float, n: int, act: float) -> tuple[float, float]:
    """(0, 0): no SP-TP-SP attention schedule is modelled for V4 (TP splits its query heads
    and output groups only; K=V, the compressors and the indexer are whole on every rank,
    engine/v4/tp.py)."""
    return 0.0, 0.0


def tp_allreduces_per_layer(ep: bool) -> int:
    """TP all-reduces of the hidden state per layer, EP or not (``ep`` unused; V3's
    signature): after the grouped output projection (TP splits the query heads by whole
    output groups) and after the MoE (engine/v4/model.py: the TP-split shared expert's partial
    sum plus the routed experts', TP-split, or under EP complete on each TP rank's token slice,
    engine/v4/expert_parallel.py): two, as V3."""
    del ep
    return 2


def kv_bytes_per_request(m: V4Config, prec: Precision, num_tokens: int) -> float:
    """Bytes of a request's KV after ``num_tokens`` tokens (what PD ships): window, entries,
    index keys, compressor state, from the spec."""
    return _request_bytes(m, num_tokens, prec.kv)


def kv_bytes_per_token(m: V4Config, prec: Precision) -> float:
    """KV bytes one computed token writes, all layers: its raw K=V in every layer's window and
    its share of the compressed entries (``1 / ratio`` of an entry and, CSA, an index key)."""
    rates, kinds = dict(m.compress_rates), _kinds(m)
    entries = kinds[CSA] * (m.head_dim + m.index_head_dim) / rates[CSA] \
        + kinds[HCA] * m.head_dim / rates[HCA]
    return (m.num_hidden_layers * m.head_dim + entries) * prec.kv


def kv_read_per_seq(m: V4Config, prec: Precision, context: float) -> float:
    """KV bytes one decode step reads for one sequence of ``context`` tokens:
    :func:`engine.kv_layer_spec.read_bytes` of the V4 layer specs (every layer's window,
    HCA's entries, CSA's top-k entries and all its index keys: the indexer scores them all)."""
    return read_bytes(layer_specs(m), context, prec.kv)


def elementwise_bytes_per_token(m: V4Config, act: float, eight_bit: bool,
                                prefill: bool) -> tuple[float, float, float]:
    """HBM bytes one token moves between the GEMMs, all layers: (attention phase, MoE phase
    less the routed copies, per routed copy), as :func:`.counts.elementwise_bytes_per_token`
    counts V3's, with V4's tensors: per mHC (two a layer) read the ``hc_mult`` streams and
    write them back mixed (``2 N h``) and read + write the block input (``2 h``); attention:
    the q latent and kv norms, q's unweighted norm and RoPE on all heads (read + write ``H D``
    twice), the output's inverse RoPE (``2 H D``), quantizing the GEMM inputs (hidden, q latent,
    ``H D`` output); MoE: RMSNorm (``2 h``), router logits (fp32), the shared expert's
    clipped SwiGLU, the combine; per routed copy its SwiGLU (+ prefill's expert-contiguous
    copy)."""
    h, hd, n = m.hidden_size, m.num_attention_heads * m.head_dim, m.hc_mult
    quant = act + 1 if eight_bit else 0.0
    inter, k = m.moe_intermediate_size, m.num_experts_per_tok
    hc = (2 * n * h + 2 * h) * act

    def glu(width: int) -> float:
        return 3 * width * act + width * quant

    attn = hc + 2 * (m.q_lora_rank + m.head_dim) * act + 6 * hd * act \
        + (h + m.q_lora_rank + hd) * quant
    moe = hc + 2 * h * act + h * quant + 2 * m.n_routed_experts * 4 + glu(inter) \
        + (k + 1) * h * act
    per_copy = glu(inter) + (2 * h * ((1 + 4 / 128) if eight_bit else act) if prefill else 0.0)
    layers = m.num_hidden_layers
    return layers * attn, layers * moe, layers * per_copy

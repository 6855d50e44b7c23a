"""What one token costs in parameters, FLOPs and KV bytes (no device, no layout).

- parameters a token multiplies with: MLA projections on all heads (V3.2: plus the indexer's
  projections), dense MLP layers, and per MoE layer the shared experts, the router gate and
  ``num_experts_per_tok`` routed experts; lm_head not included;
- attention FLOPs: dense MLA in MHA form over the causal prefix (prefill) or absorbed over
  the whole context (decode); V3.2 sparse attention over ``min(context, index_topk)`` keys in
  absorbed form plus the indexer's ``index_n_heads x index_head_dim`` dot products over the
  whole prefix;
- KV bytes: what a request holds and what a decode step reads of it, from the layer specs
  (:mod:`engine.kv_layer_spec`: latent + rope key, + index key on DSA indexer layers, per
  token and layer; DSA reads the top-k latents).
"""

from __future__ import annotations

from engine.kv_layer_spec import held_bytes, mla_layer_specs, read_bytes
from engine.model_config import ModelConfig
from orchestrator.config.memory_plan import Precision
from orchestrator.config.weight_rows import num_moe_layers


def attention_params_per_layer(m: ModelConfig) -> int:
    """Weights of one layer's MLA linears (all heads; the DSA indexer is
    :func:`indexer_params`, on the layers that have one)."""
    heads, h = m.num_attention_heads, m.hidden_size
    q = (h * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim) if m.q_lora_rank \
        else h * heads * m.qk_head_dim
    attn = q + h * (m.kv_lora_rank + m.qk_rope_head_dim) \
        + m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim) + heads * m.v_head_dim * h
    return attn


def indexer_params(m: ModelConfig) -> int:
    """Weights of one DSA indexer (``wq_b``, ``wk``, ``weights_proj``); 0 without DSA."""
    if not m.uses_sparse_attention:
        return 0
    h = m.hidden_size
    return m.q_lora_rank * m.index_n_heads * m.index_head_dim + h * (m.index_head_dim
                                                                     + m.index_n_heads)


def dense_params_per_token(m: ModelConfig) -> int:
    """Weights every token multiplies with outside the routed and shared experts: attention
    linears of every layer, dense MLP layers, the router gate of each MoE layer."""
    moe = num_moe_layers(m)
    dense_mlp = (m.num_hidden_layers - moe) * 3 * m.hidden_size * m.intermediate_size
    gate = moe * (m.n_routed_experts or 0) * m.hidden_size
    # NOTE: only indexer layers have indexer weights (GLM-5.2's shared layers reuse a selection)
    return (m.num_hidden_layers * attention_params_per_layer(m)
            + sum(m.indexer_layers) * indexer_params(m) + dense_mlp + gate)


def output_params_per_token(m: ModelConfig) -> int:
    """The part of :func:`dense_params_per_token` after the core attention: every layer's
    output projection (``heads x v_head_dim x hidden``) and each MoE layer's router gate."""
    out = m.num_hidden_layers * m.num_attention_heads * m.v_head_dim * m.hidden_size
    return out + num_moe_layers(m) * (m.n_routed_experts or 0) * m.hidden_size


def expert_params(m: ModelConfig) -> int:
    """Weights of one expert (gate, up, down) of one layer."""
    return 3 * m.hidden_size * m.moe_intermediate_size


def shared_params_per_token(m: ModelConfig) -> int:
    """Weights of the shared experts a token runs, over all MoE layers."""
    return num_moe_layers(m) * m.n_shared_experts * expert_params(m)


def routed_params_per_token(m: ModelConfig) -> int:
    """Weights of the routed experts a token runs, over all MoE layers."""
    return num_moe_layers(m) * m.num_experts_per_tok * expert_params(m)


def linear_params_per_token(m: ModelConfig) -> int:
    """Weights one token multiplies with over all decoder layers (lm_head not included)."""
    return dense_params_per_token(m) + shared_params_per_token(m) + routed_params_per_token(m)


def attention_flops(m: ModelConfig, new: int, past: int, absorbed: bool | None = None) -> float:
    """FLOPs of attention (all layers, all heads) for ``new`` tokens after ``past`` cached
    ones, causal; dense MLA in MHA form (prefill) or ``absorbed`` (default: ``new`` == 1,
    decode; MTP verification passes True)."""
    heads, layers = m.num_attention_heads, m.num_hidden_layers
    keys = new * past + new * (new + 1) / 2  # sum over new tokens of the keys each sees
    absorbed = new == 1 if absorbed is None else absorbed
    if not m.uses_sparse_attention:
        per_key = (2 * m.kv_lora_rank + m.qk_rope_head_dim) if absorbed else \
            (m.qk_head_dim + m.v_head_dim)
        return 2.0 * layers * heads * per_key * keys
    capped = sum_min(past, new, m.index_topk)
    width = 2 * m.kv_lora_rank + m.qk_rope_head_dim
    # NOTE: only indexer layers score every key (shared layers reuse the last selection)
    return 2.0 * (layers * heads * width * capped
                  + sum(m.indexer_layers) * m.index_n_heads * m.index_head_dim * keys)


def mha_keys(m: ModelConfig, new: int, past: int) -> float:
    """Keys a query of a prefill chunk of ``new`` tokens after ``past`` ones sees on
    average, causal, when the chunk attends in MHA form (dense MLA prefill: per-head keys
    and values); 0 for sparse (V3.2) attention, which attends in absorbed form. Example:
    one whole 2048-token prompt: 1024.5."""
    if m.uses_sparse_attention or new <= 0:
        return 0.0
    return past + (new + 1) / 2


def prefix_up_flops(m: ModelConfig, past: int) -> float:
    """FLOPs of expanding ``past`` cached latents to per-head keys and values (``kv_b_proj``,
    all layers) for a prefill chunk in MHA form that attends over them: a chunk after a
    cached or earlier-chunk prefix re-expands it (its K/V are not kept, only the latents).
    0 for sparse (V3.2) attention, which attends in absorbed form."""
    if m.uses_sparse_attention or past <= 0:
        return 0.0
    return 2.0 * m.num_hidden_layers * past * m.kv_lora_rank * m.num_attention_heads \
        * (m.qk_nope_head_dim + m.v_head_dim)


def sp_tp_bytes(m: ModelConfig, tokens: float, n: int, act: float) -> tuple[float, float]:
    """Bytes one rank moves per layer for prefill's SP-TP-SP attention (CloudMatrix-Infer,
    arXiv:2506.12708 sec. 4 "hybrid parallelism"): the down projections and o_proj run on
    the rank's own ``tokens`` (sequence parallel), the attention core by heads over ``n``
    ranks (tensor parallel), joined by one all-gather of the latents (q latent, KV latent,
    k_pe: every rank receives the other ``n - 1`` ranks' ``tokens``) and one all-to-all of
    the attention output back to the tokens' ranks (``(n - 1) / n`` of the rank's heads x
    ``n x tokens`` rows leave it). ``act`` bytes per value. Returns (gathered, all-to-all)
    bytes per layer; (0, 0) for n <= 1. Example: V3 (1536 + 512 + 64 latent values,
    128 heads x 128 v values), 8192 tokens, n 32, bf16: 31 x 8192 x 4224 B = 1.07 GB
    gathered, 31/32 x 8192 x 32768 B = 260 MB all-to-all."""
    if n <= 1:
        return 0.0, 0.0
    latent = (m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_rope_head_dim
    out = m.num_attention_heads * m.v_head_dim
    return (n - 1) * tokens * latent * act, (n - 1) / n * tokens * out * act


def sum_min(past: int, new: int, k: int) -> float:
    """sum over t in past+1 .. past+new of min(t, k)."""
    lo, hi = past + 1, past + new
    a_hi, b_lo = min(hi, k), max(lo, k + 1)
    below = (a_hi - lo + 1) * (lo + a_hi) / 2 if lo <= a_hi else 0.0
    return below + (hi - b_lo + 1) * k if b_lo <= hi else below


def kv_bytes_per_token(m: ModelConfig, prec: Precision) -> float:
    """KV cache bytes of one token over all decoder layers (latent, k_pe; DSA index_k on the
    indexer layers): :func:`kv_bytes_per_request` of one token."""
    return kv_bytes_per_request(m, prec, 1)


def tp_allreduces_per_layer(ep: bool) -> int:
    """TP all-reduces of the hidden state per decoder layer: after o_proj and after the MLP
    (with EP the routed experts' combine is the all-to-all's, the TP-split shared experts'
    still needs one)."""
    return 2


def kv_bytes_per_request(m: ModelConfig, prec: Precision, num_tokens: int) -> float:
    """KV bytes of a request after ``num_tokens`` tokens (what PD ships), every decoder
    layer: :func:`engine.kv_layer_spec.held_bytes` of the model's layer specs (every token
    keeps its latent in every layer: ``num_tokens`` x :func:`kv_bytes_per_token`)."""
    return held_bytes(mla_layer_specs(m), num_tokens, prec.kv)


def kv_read_per_seq(m: ModelConfig, prec: Precision, context: float) -> float:
    """KV bytes one decode step reads for one sequence of ``context`` tokens, every decoder
    layer: :func:`engine.kv_layer_spec.read_bytes` of the model's layer specs (latent + k_pe
    of every token; V3.2: of the top ``index_topk``, plus the index keys of the whole context
    on the indexer layers)."""
    return read_bytes(mla_layer_specs(m), context, prec.kv)


def expert_active_share(m: ModelConfig, tokens: float) -> float:
    """Expected share of routed experts at least one of ``tokens`` tokens picks."""
    experts = m.n_routed_experts or 0
    if not experts:
        return 0.0
    return 1 - (1 - m.num_experts_per_tok / experts) ** tokens


def elementwise_bytes_per_token(m: ModelConfig, act: float, eight_bit: bool,
                                prefill: bool) -> tuple[float, float, float]:
    """HBM bytes one token moves through the kernels between the GEMMs, summed over the
    layers: (attention phase with the dense MLP layers, MoE phase less the routed copies,
    per routed expert copy).

    Counted per layer (``act`` bytes per activation value; an 8-bit GEMM input is first
    quantized: read ``act``, write 1 byte per value):
    - attention: fused residual add + RMSNorm (read and write hidden and residual, ``4h``),
      the q_a / kv_a latent norms (read + write ``q_lora_rank + kv_lora_rank``), RoPE on
      q_pe (all heads) and k_pe (read + write), quantizing the GEMM inputs (hidden, q
      latent, attention output ``heads x v_head_dim``); prefill's MHA form also writes and
      reads the per-head keys (``heads x (qk_nope + qk_head_dim)``: k_nope read, k = [k_nope,
      k_pe] written);
    - MoE layer: add + RMSNorm (``4h``), quantizing the hidden for the shared expert, router
      logits (fp32, read + write per expert), the shared experts' SiLU x up (read ``2 I``,
      write ``I``, plus quantizing ``I``), the weighted combine (read ``k`` outputs, write
      one); per routed copy the same SiLU x up and quantization at ``moe_intermediate_size``;
    - dense MLP layers: add + RMSNorm, quantizing the hidden, SiLU x up at
      ``intermediate_size``;
    - prefill only, per routed copy: the received copy moved into the grouped GEMM's
      expert-contiguous layout (read + write ``h`` values at the dispatch's width: 1 byte +
      a 4-byte scale per 128 when 8-bit, else ``act``); the prefill all-to-all (DeepEP's
      normal kernels) delivers tokens by source rank, DeepGEMM's contiguous layout wants
      them by expert (SGLang's ``ep_scatter``); decode's low-latency kernels write the
      masked layout directly.
    The GEMMs' own activation reads and writes are not here (their rooflines count weights),
    nor the all-to-all's packing (the EP library's op).
    """
    h, heads = m.hidden_size, m.num_attention_heads
    quant = act + 1 if eight_bit else 0.0

    def glu(inter: int) -> float:  # SiLU(gate) x up, then quantized for the down GEMM
        return 3 * inter * act + inter * quant

    lora = (m.q_lora_rank or 0) + m.kv_lora_rank
    attn = (4 * h * act + 2 * lora * act + 2 * (heads + 1) * m.qk_rope_head_dim * act
            + (h + (m.q_lora_rank or 0) + heads * m.v_head_dim) * quant)
    if prefill:
        attn += heads * (m.qk_nope_head_dim + m.qk_head_dim) * act
    moe_layers = num_moe_layers(m)
    dense_layers = m.num_hidden_layers - moe_layers
    k, experts = m.num_experts_per_tok, m.n_routed_experts or 0
    moe = (4 * h * act + h * quant + 2 * experts * 4 + m.n_shared_experts
           * glu(m.moe_intermediate_size) + (k + 1) * h * act) if experts else 0.0
    dense = 4 * h * act + h * quant + glu(m.intermediate_size)
    per_copy = glu(m.moe_intermediate_size) if experts else 0.0
    if prefill and experts:
        per_copy += 2 * h * ((1 + 4 / 128) if eight_bit else act)  # expert-contiguous layout
    # NOTE: the dense MLP layers run in the attention phase (with the other linears)
    return (m.num_hidden_layers * attn + dense_layers * dense, moe_layers * moe,
            moe_layers * per_copy)

"""The workspace and communicator rows of the memory plan: device memory a rank needs
beyond its weights and KV cache.

Workspace: the live activations of one layer of a step and the step's fp32 logits (an
estimate; weights of the layer-sharding prefetch pool are a weight row,
:func:`.weight_rows.prefetch_pool`). Communicator buffers (device memory each NCCL/HCCL group
holds outside PyTorch's allocator): the rank's communicators x the backend's buffer. Each
row function maps (model, layout) to (elements per rank, how they are split, in words).
"""

from __future__ import annotations

from engine.model_config import ModelConfig
from orchestrator.config.role_layout import RoleLayout, rank_layout


def activations(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """Live activations of one layer of a step of ``step_tokens`` tokens (an estimate)."""
    # NOTE: an estimate of the live tensors of one layer (they are reused layer to layer),
    # assuming fused (flash / paged) attention kernels that never hold a score matrix:
    # per step token: 4 hidden-wide tensors (residual, normed input, attention and MLP out),
    # the q and kv latents, MHA-form q, k, v and output on local heads, and per routed
    # expert choice its dispatched copy in and out plus gate, up and SwiGLU intermediates;
    # chunked prefill also decompresses the cached prefix (max_model_len tokens) on local
    # heads.
    local = rank_layout(m, lay)
    heads, inter = local.num_attention_heads, local.expert_intermediate_size
    per_token = 4 * m.hidden_size + (m.q_lora_rank or 0) + m.kv_lora_rank \
        + m.qk_rope_head_dim + heads * 2 * (m.qk_head_dim + m.v_head_dim) \
        + m.num_experts_per_tok * (2 * m.hidden_size + 3 * inter)
    prefix = 0 if lay.role == "decode" else \
        lay.max_model_len * heads * (m.qk_nope_head_dim + m.v_head_dim)
    mine = -(-lay.step_tokens // lay.cp)  # NOTE: CP: each rank computes 1/cp of a step
    cp = f" / cp {lay.cp}" if lay.cp > 1 else ""
    return mine * per_token + prefix, f"{lay.step_tokens} step tokens{cp} (estimate)"


def logits(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """The step's logits [max_num_seqs, vocab], fp32 over the full vocabulary."""
    return lay.max_num_seqs * m.vocab_size, f"{lay.max_num_seqs} seqs x full vocab, fp32"


def pair_buffers(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """Bytes the rank's KV pair groups hold (one buffer each)."""
    return lay.pair_groups * lay.pair_buffer_bytes, \
        f"{lay.pair_groups} KV pair group(s) x {lay.pair_buffer_bytes / 1e6:g} MB"


def collective_buffers(m: ModelConfig, lay: RoleLayout) -> tuple[int, str]:
    """Bytes the rank's TP / EP / CP communicators hold (one buffer each)."""
    names = lay.collectives
    return len(names) * lay.comm_buffer_bytes, \
        f"{' + '.join(names) or 'none'} x {lay.comm_buffer_bytes / 1e6:g} MB"

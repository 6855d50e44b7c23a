"""Paged MLA KV cache: separate K and V tensors per layer.

For MLA (DeepSeek-V2/V3) the per-token cache is the normalized latent ``c_kv`` and the roped
shared key ``k_pe``. orch keeps them as two tensors per layer, never one 576-wide tensor:

- K cache of layer i: ``[num_blocks, block_size, kv_lora_rank]`` (512 for V3)
- V cache of layer i: ``[num_blocks, block_size, qk_rope_head_dim]`` (64 for V3)

Both are identical on every TP rank of an instance (the latent has no head axis). The k_pe
layout is interleaved-pair rope (DeepSeek / vLLM convention, see REFERENCE.md "Rope layout");
:attr:`KVCacheSpec.rope_layout` names it so the transfer fingerprint can include it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one instance's paged KV cache.

    Attributes:
        num_layers: decoder layers with a cache.
        num_blocks: physical blocks per layer.
        block_size: tokens per block.
        kv_lora_rank: K width (latent c_kv), elements per token.
        qk_rope_head_dim: V width (k_pe), elements per token.
        dtype: element dtype of both caches.
        rope_layout: "interleaved" (GPT-J pairs, DeepSeek/vLLM) for the k_pe cache.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype = torch.float32
    rope_layout: str = "interleaved"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "kv_lora_rank",
                     "qk_rope_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K + V bytes of one token in one layer (1,152 B for V3 in bf16)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return (self.kv_lora_rank + self.qk_rope_head_dim) * elem


class KVCache:
    """The K and V cache tensors of one rank.

    Attributes:
        spec: the :class:`KVCacheSpec` it was built from.
        k_caches: per layer ``[num_blocks, block_size, kv_lora_rank]``.
        v_caches: per layer ``[num_blocks, block_size, qk_rope_head_dim]``.

    Ownership: the model writes with ``reshape_and_cache`` (one write per layer per step);
    the KV transfer layer reads (prefill) or writes (decode) whole token slots. Nobody
    reallocates the tensors after construction, so views and data pointers stay valid.
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.device = torch.device(device)
        shape_k = (spec.num_blocks, spec.block_size, spec.kv_lora_rank)
        shape_v = (spec.num_blocks, spec.block_size, spec.qk_rope_head_dim)
        self.k_caches = [torch.zeros(shape_k, dtype=spec.dtype, device=self.device)
                         for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape_v, dtype=spec.dtype, device=self.device)
                         for _ in range(spec.num_layers)]

    def flat_k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K cache viewed ``[num_blocks * block_size, kv_lora_rank]`` (slots)."""
        return self.k_caches[layer].view(-1, self.spec.kv_lora_rank)

    def flat_v(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V cache viewed ``[num_blocks * block_size, qk_rope_head_dim]``."""
        return self.v_caches[layer].view(-1, self.spec.qk_rope_head_dim)

"""Paged MLA KV cache: separate K, V (and, for DeepSeek-V3.2, index_k) tensors per layer.

For MLA (DeepSeek-V2/V3) the per-token cache is the normalized latent ``c_kv`` and the roped
shared key ``k_pe``. orch keeps them as separate tensors per layer, never one wide tensor:

- K cache of layer i: ``[num_blocks, block_size, kv_lora_rank]`` (512 for V3)
- V cache of layer i: ``[num_blocks, block_size, qk_rope_head_dim]`` (64 for V3)
- index_k cache of layer i (DSA only, ``index_head_dim > 0``, and only on layers with an
  indexer: GLM-5.2's shared layers have none, :attr:`KVCacheSpec.index_layers`):
  ``[num_blocks, block_size, index_head_dim]`` (128 for V3.2), the lightning indexer's keys
  (:mod:`engine.indexer`).

What layer i caches is :meth:`KVCacheSpec.layer_spec` (an
:class:`engine.kv_layer_spec.MLALayerSpec`, the per-layer spec vocabulary DeepSeek-V4 shares):
:class:`KVCache` allocates its tensors, :meth:`KVCacheSpec.bytes_per_token_of` counts and the
transfer layout (``kv_transfer.layout.KVLayout.from_spec``) lists its buffers from it.

All are identical on every TP rank of an instance (no head axis). The k_pe layout is
interleaved-pair rope (DeepSeek / vLLM convention, see REFERENCE.md "Rope layout");
:attr:`KVCacheSpec.rope_layout` names it so the transfer fingerprint can include it.

NOTE: the indexer keys are stored in the cache dtype. The released V3.2 kernels (vLLM,
vLLM-Ascend) keep them in FP8 (e4m3 plus a per-token scale) after a Hadamard rotation; we keep
the cache dtype so the scores equal the transformers reference.

Every buffer of every layer is its own contiguous allocation: a layer's slot ``s``
(``engine.block_pool.slot_mapping``) is row ``s`` of the layer's cache viewed ``[num_blocks *
block_size, width]`` (:meth:`KVCache.flat_buffers`). Device MLA kernels (FlashMLA on CUDA,
``torch_npu`` MLA on Ascend) read exactly this: one contiguous paged cache per layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from engine.kv_layer_spec import MLALayerSpec, held_elements


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape and dtype of one instance's paged KV cache.

    Attributes:
        num_layers: decoder layers with a cache.
        num_blocks: physical blocks per layer.
        block_size: tokens per block.
        kv_lora_rank: K width (latent c_kv), elements per token.
        qk_rope_head_dim: V width (k_pe), elements per token.
        dtype: element dtype of every cache buffer.
        rope_layout: "interleaved" (GPT-J pairs, DeepSeek/vLLM) for the k_pe cache.
        index_head_dim: index_k width (DSA lightning indexer keys); 0 = no indexer cache (V3).
        index_layers: per layer, whether it has an index_k buffer (False on GLM-5.2's shared
            layers); empty = every layer has one when ``index_head_dim`` > 0.
        mtp_layers: the last ``mtp_layers`` of ``num_layers`` are the MTP module's caches
            (speculative decoding, :mod:`engine.spec_forward`); 0: none.
        index_topk: DSA's top-k (tokens a query's attention reads,
            :attr:`engine.kv_layer_spec.MLALayerSpec.index_topk`); 0: dense. Shapes nothing.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype = torch.float32
    rope_layout: str = "interleaved"
    index_head_dim: int = 0
    index_layers: tuple[bool, ...] = ()
    mtp_layers: int = 0
    index_topk: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "kv_lora_rank",
                     "qk_rope_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        if self.index_head_dim < 0:
            raise ValueError(f"KVCacheSpec.index_head_dim must be >= 0 (0: no indexer cache), "
                             f"got {self.index_head_dim}")
        if self.index_layers and (len(self.index_layers) != self.num_layers
                                  or not self.index_head_dim):
            raise ValueError(f"KVCacheSpec.index_layers must give one flag per layer "
                             f"({self.num_layers}) and needs index_head_dim > 0; got "
                             f"{len(self.index_layers)} flags, index_head_dim "
                             f"{self.index_head_dim}")
        if self.index_layers and len(set(self.index_layers)) == 1:
            raise ValueError(f"KVCacheSpec.index_layers names the layers with index_k only when "
                             f"some lack it (KVCacheSpec.from_layer_specs); got all "
                             f"{self.index_layers[0]}: leave it empty (every layer has index_k) "
                             f"or set index_head_dim 0 (none has)")

    @classmethod
    def from_layer_specs(cls, layers: Sequence[MLALayerSpec], *, num_blocks: int,
                         block_size: int, dtype: torch.dtype = torch.float32,
                         mtp_layers: int = 0) -> KVCacheSpec:
        """The paged cache of ``layers`` (one :class:`engine.kv_layer_spec.MLALayerSpec` per
        layer, MTP layers last: :func:`engine.kv_layer_spec.mla_layer_specs`) in ``num_blocks``
        blocks of ``block_size`` tokens (the ``kv`` pool of :func:`engine.pool_plan.plan_pools`);
        its :meth:`layer_specs` are ``layers``.

        Raises:
            ValueError: no layers, a layer that is not MLA, or layers of different ``k`` /
                ``v`` / ``index_k`` widths or ``index_topk`` (one paged cache has one of each).
        """
        kinds = set(layers)
        if not layers or not all(isinstance(s, MLALayerSpec) for s in kinds):
            raise ValueError(f"KVCacheSpec holds MLA layers (MLALayerSpec); got "
                             f"{sorted({type(s).__name__ for s in kinds}) or 'no layers'}")
        widths = {(s.kv_lora_rank, s.qk_rope_head_dim, s.index_topk) for s in kinds}
        index = {s.index_head_dim for s in kinds if s.index_head_dim}
        if len(widths) > 1 or len(index) > 1:
            raise ValueError(f"one paged KV cache has one k / v / index_k width; the layers "
                             f"have (kv_lora_rank, qk_rope_head_dim, index_topk) {sorted(widths)}"
                             f" and index_head_dim {sorted(index)}")
        (kv_lora_rank, rope, topk), flags = widths.pop(), tuple(s.index_head_dim > 0
                                                                for s in layers)
        return cls(num_layers=len(layers), num_blocks=num_blocks, block_size=block_size,
                   kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, dtype=dtype,
                   index_head_dim=index.pop() if index else 0,
                   index_layers=flags if len(set(flags)) > 1 else (), mtp_layers=mtp_layers,
                   index_topk=topk)

    def has_index_k(self, layer: int) -> bool:
        """True when layer ``layer`` has an index_k buffer."""
        return bool(self.index_head_dim) and (not self.index_layers or self.index_layers[layer])

    def buffers(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Every buffer kind of the layer specs, in cache order: name -> (elements per token,
        the layers that have it)."""
        out: dict[str, tuple[int, list[int]]] = {}
        for i, layer in enumerate(self.layer_specs()):
            for t in layer.tensors():
                out.setdefault(t.name, (t.width, []))[1].append(i)
        return {name: (width, tuple(layers)) for name, (width, layers) in out.items()}

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """Names of every buffer kind, in cache order: ``("k", "v"[, "index_k"])`` (a layer has
        these or a prefix of them: :meth:`layer_buffer_names`)."""
        return tuple(self.buffers())

    @property
    def buffer_widths(self) -> tuple[int, ...]:
        """Elements per token of each buffer kind, in :attr:`buffer_names` order."""
        return tuple(width for width, _ in self.buffers().values())

    @cached_property
    def _layer_specs(self) -> tuple[MLALayerSpec, ...]:
        # NOTE: cached in the instance __dict__ (fields are frozen; eq / hash ignore it)
        kinds = {flag: MLALayerSpec(self.kv_lora_rank, self.qk_rope_head_dim,
                                    self.index_head_dim if flag else 0, self.index_topk)
                 for flag in (False, True)}
        return tuple(kinds[self.has_index_k(i)] for i in range(self.num_layers))

    def layer_spec(self, layer: int) -> MLALayerSpec:
        """What layer ``layer`` caches (:class:`engine.kv_layer_spec.MLALayerSpec`: ``k``,
        ``v`` and, where :meth:`has_index_k`, ``index_k``, one row per token each)."""
        return self._layer_specs[layer]

    def layer_specs(self) -> tuple[MLALayerSpec, ...]:
        """:meth:`layer_spec` of every layer, MTP layers last (the kind of tuple
        :func:`engine.v4.kv_spec.layer_specs` gives for DeepSeek-V4; layers of one kind share
        one object)."""
        return self._layer_specs

    def layer_buffer_names(self, layer: int) -> tuple[str, ...]:
        """The buffers layer ``layer`` has, in cache order (no index_k on a shared layer)."""
        return tuple(t.name for t in self.layer_spec(layer).tensors())

    def layer_buffer_widths(self, layer: int) -> tuple[int, ...]:
        """Elements per token of each of layer ``layer``'s buffers."""
        return tuple(t.width for t in self.layer_spec(layer).tensors())

    @property
    def element_size(self) -> int:
        """Bytes per cache element (``dtype``'s)."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token over all layers and their buffers."""
        return self.bytes_per_token_of(range(self.num_layers))

    def bytes_per_token_of(self, layers: Iterable[int]) -> int:
        """Bytes of one token over ``layers``, each with the buffers it has
        (:func:`engine.kv_layer_spec.held_elements` of one token)."""
        return held_elements(self.layer_specs(), 1, layers) * self.element_size

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of one token in one layer over all buffers (1,152 B for V3 in bf16, 1,408 B
        for V3.2), the mean over layers where they differ (GLM-5.2's shared layers)."""
        return self.bytes_per_token // self.num_layers


class KVCache:
    """The cache tensors of one rank.

    Attributes:
        spec: the :class:`KVCacheSpec` it was built from.
        k_caches: per layer ``[num_blocks, block_size, kv_lora_rank]``.
        v_caches: per layer ``[num_blocks, block_size, qk_rope_head_dim]``.
        index_caches: per layer ``[num_blocks, block_size, index_head_dim]``, None on a layer
            without one (GLM-5.2 shared); empty for V3.
        scratch_block: with ``scratch_block=True``, the id (``spec.num_blocks``) of one extra
            physical block after the spec's blocks, which no block pool hands out (pools are
            sized from the spec): graph mode's padding rows write their KV there
            (:mod:`engine.graph`). None without it. Every buffer then has
            ``num_blocks + 1`` blocks.

    Ownership: the model writes with ``reshape_and_cache`` (one write per buffer per layer per
    step); the KV transfer layer reads (prefill) or writes (decode) whole token slots. Nobody
    reallocates the tensors after construction, so views and data pointers stay valid.
    """

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu", *,
                 scratch_block: bool = False) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.scratch_block = spec.num_blocks if scratch_block else None
        blocks = spec.num_blocks + int(scratch_block)

        def alloc(width: int) -> torch.Tensor:
            return torch.zeros(blocks, spec.block_size, width, dtype=spec.dtype,
                               device=self.device)

        # NOTE: one tensor per cached tensor of each layer's spec (k, v[, index_k])
        caches = [{t.name: alloc(t.width) for t in layer.tensors()}
                  for layer in spec.layer_specs()]
        self.k_caches = [c["k"] for c in caches]
        self.v_caches = [c["v"] for c in caches]
        self.index_caches: list[torch.Tensor | None] = [
            c.get("index_k") for c in caches] if spec.index_head_dim else []

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s caches ``[num_blocks, block_size, width]`` in
        ``spec.layer_buffer_names(layer)`` order (K, V[, index_k]), each contiguous."""
        index = (self.index_caches[layer],) if self.spec.has_index_k(layer) else ()
        return (self.k_caches[layer], self.v_caches[layer]) + index

    def flat_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s caches viewed as slots ``[num_blocks * block_size, width]`` (row
        ``s`` is slot ``s``; views, no copy), in ``buffer_names`` order."""
        return tuple(buf.view(-1, buf.shape[-1]) for buf in self.layer_buffers(layer))

    def flat_k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K as slots (:meth:`flat_buffers`)."""
        return self.flat_buffers(layer)[0]

    def flat_v(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V as slots (:meth:`flat_buffers`)."""
        return self.flat_buffers(layer)[1]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of layer ``layer``'s rows at ``slots`` (int64 ``[T]``): ``[T, width]`` per
        buffer, in ``buffer_names`` order (checks and tests; the model indexes in place)."""
        return tuple(buf.index_select(0, slots) for buf in self.flat_buffers(layer))

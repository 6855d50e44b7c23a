"""Paged MLA KV cache: separate K, V (and, for DeepSeek-V3.2, index_k) tensors per layer.

For MLA (DeepSeek-V2/V3) the per-token cache is the normalized latent ``c_kv`` and the roped
shared key ``k_pe``. orch keeps them as separate tensors per layer, never one wide tensor:

- K cache of layer i: ``[num_blocks, block_size, kv_lora_rank]`` (512 for V3)
- V cache of layer i: ``[num_blocks, block_size, qk_rope_head_dim]`` (64 for V3)
- index_k cache of layer i (V3.2 only, ``index_head_dim > 0``):
  ``[num_blocks, block_size, index_head_dim]`` (128 for V3.2), the lightning indexer's keys
  (:mod:`engine.indexer`).

All are identical on every TP rank of an instance (no head axis). The k_pe layout is
interleaved-pair rope (DeepSeek / vLLM convention, see REFERENCE.md "Rope layout");
:attr:`KVCacheSpec.rope_layout` names it so the transfer fingerprint can include it.

NOTE: the indexer keys are stored in the cache dtype. The released V3.2 kernels (vLLM,
vLLM-Ascend) keep them in FP8 (e4m3 plus a per-token scale) after a Hadamard rotation; we keep
the cache dtype so the scores equal the transformers reference.

Physical layout (``KVCache.layout``), the same per-layer shapes either way:

- ``layer_major``: one allocation per layer and buffer; each layer's cache is contiguous.
  What device MLA kernels read (FlashMLA on CUDA, ``torch_npu`` MLA on Ascend take one
  contiguous ``[num_blocks, block_size, ...]`` cache per layer), so the default on ``cuda`` and
  ``npu``.
- ``block_major``: one allocation per buffer, ``[num_blocks, num_layers, block_size, width]``;
  layer i's cache is the strided view ``[:, i]``. One block's rows of EVERY layer are one
  contiguous run, so a fragmented block table ships as one message per block (7.8 MB for
  DeepSeek-V3's K at block 128 in bf16) instead of one per block and layer (128 KiB): gloo
  moves 128 KiB messages at about half its large-message rate (``docs/performance.md``).
  The default on ``cpu``. Same idea as vLLM's cross-layer KV blocks (vllm-project/vllm
  #27742, #27743), which vLLM keeps off for MLA because its device kernels need contiguous
  per-layer caches: so do ours, hence ``layer_major`` there.

A layer's slot ``s`` (``engine.block_pool.slot_mapping``) is row ``slot_index(cache, s)`` of
``slot_rows(cache)``: the identity for ``layer_major``, ``s + (s // block_size) *
(num_layers - 1) * block_size`` for ``block_major``. Code that indexes a cache by slot goes
through these two functions (or indexes ``[block, offset]``), never ``cache.view(-1, width)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CACHE_LAYOUTS = ("layer_major", "block_major")


def default_layout(device_type: str) -> str:
    """The physical layout for a device type: ``block_major`` on ``cpu`` (fragmented block
    tables ship as one message per block), ``layer_major`` where device kernels need one
    contiguous cache per layer (``cuda``, ``npu``)."""
    return "block_major" if device_type == "cpu" else "layer_major"


def slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """One layer's cache ``[num_blocks, block_size, *D]`` as token rows ``[R, *D]`` (a view,
    no copy): slot ``s`` is row :func:`slot_index` ``(cache, s)``.

    For a contiguous cache this is ``cache.view(num_blocks * block_size, *D)``; for a layer of
    a ``block_major`` cache the view spans the rows of the other layers too (it is only ever
    indexed through :func:`slot_index`).

    Raises:
        ValueError: the cache's token rows are not contiguous or blocks are not a whole number
            of rows apart (not a cache :class:`KVCache` built).
    """
    nb, bs, dims = cache.shape[0], cache.shape[1], tuple(cache.shape[2:])
    row = math.prod(dims)
    if cache.is_contiguous():
        return cache.view(nb * bs, *dims)
    if cache.stride(1) != row or cache.stride(0) % row or not cache[0, 0].is_contiguous():
        raise ValueError(f"cache of shape {tuple(cache.shape)} and strides {cache.stride()} "
                         "has no row view: token rows must be contiguous and blocks a whole "
                         "number of rows apart (build caches with engine.kv_cache.KVCache)")
    per_block = cache.stride(0) // row
    # NOTE: no storage_offset argument: the view keeps the cache's (graph capture traces it).
    return cache.as_strided(((nb - 1) * per_block + bs, *dims), cache.stride()[1:])


def skip_rows(slots: torch.Tensor, block_size: int, rows_per_block: int) -> torch.Tensor:
    """Rows of ``slots`` (int64, any shape) when consecutive blocks are ``rows_per_block``
    rows apart (``block_size * num_layers`` for ``block_major``): ``slots + (slots //
    block_size) * (rows_per_block - block_size)``."""
    return slots + torch.div(slots, block_size, rounding_mode="floor") * (rows_per_block
                                                                          - block_size)


def slot_index(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows of :func:`slot_rows` ``(cache)`` holding ``slots`` (int64, any shape): ``slots``
    itself for a contiguous cache, else ``slots + (slots // block_size) * (rows_per_block -
    block_size)``."""
    bs = cache.shape[1]
    per_block = cache.stride(0) // max(cache.stride(1), 1)
    if cache.is_contiguous() or per_block == bs:
        return slots
    return skip_rows(slots, bs, per_block)


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
        index_head_dim: index_k width (V3.2 lightning indexer keys); 0 = no indexer cache (V3).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype = torch.float32
    rope_layout: str = "interleaved"
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "kv_lora_rank",
                     "qk_rope_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be positive, got {getattr(self, name)}")
        if self.index_head_dim < 0:
            raise ValueError(f"KVCacheSpec.index_head_dim must be >= 0 (0: no indexer cache), "
                             f"got {self.index_head_dim}")

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """Names of the per-layer buffers, in cache order: ``("k", "v"[, "index_k"])``."""
        return ("k", "v", "index_k") if self.index_head_dim else ("k", "v")

    @property
    def buffer_widths(self) -> tuple[int, ...]:
        """Elements per token of each buffer, in :attr:`buffer_names` order."""
        widths = (self.kv_lora_rank, self.qk_rope_head_dim)
        return widths + (self.index_head_dim,) if self.index_head_dim else widths

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Bytes of one token in one layer over all buffers (1,152 B for V3 in bf16, 1,408 B
        for V3.2)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(self.buffer_widths) * elem


class KVCache:
    """The cache tensors of one rank.

    Attributes:
        spec: the :class:`KVCacheSpec` it was built from.
        k_caches: per layer ``[num_blocks, block_size, kv_lora_rank]``.
        v_caches: per layer ``[num_blocks, block_size, qk_rope_head_dim]``.
        index_caches: per layer ``[num_blocks, block_size, index_head_dim]``; empty for V3.
        layout: ``layer_major`` or ``block_major`` (module docstring).
        backing: under ``block_major``, one ``[num_blocks, num_layers, block_size, width]``
            tensor per buffer (``buffer_names`` order) that the per-layer caches view; empty
            under ``layer_major``.
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
                 scratch_block: bool = False, layout: str | None = None) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.layout = layout or default_layout(self.device.type)
        if self.layout not in CACHE_LAYOUTS:
            raise ValueError(f"KV cache layout {self.layout!r} is not one of {CACHE_LAYOUTS}")
        self.scratch_block = spec.num_blocks if scratch_block else None
        blocks = spec.num_blocks + int(scratch_block)
        if self.layout == "block_major":
            self.backing: tuple[torch.Tensor, ...] = tuple(
                torch.zeros(blocks, spec.num_layers, spec.block_size, width, dtype=spec.dtype,
                            device=self.device) for width in spec.buffer_widths)
            per_layer = [[buf[:, i] for i in range(spec.num_layers)] for buf in self.backing]
        else:
            self.backing = ()
            per_layer = [[torch.zeros(blocks, spec.block_size, width, dtype=spec.dtype,
                                      device=self.device) for _ in range(spec.num_layers)]
                         for width in spec.buffer_widths]
        self.k_caches, self.v_caches = per_layer[0], per_layer[1]
        self.index_caches: list[torch.Tensor] = per_layer[2] if spec.index_head_dim else []

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s caches ``[num_blocks, block_size, width]`` in ``buffer_names``
        order (K, V[, index_k]); strided views under ``block_major``."""
        index = (self.index_caches[layer],) if self.index_caches else ()
        return (self.k_caches[layer], self.v_caches[layer]) + index

    def row_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s caches as token rows (:func:`slot_rows`, views), in
        ``buffer_names`` order; index them with :meth:`row_index` of the slots."""
        return tuple(slot_rows(buf) for buf in self.layer_buffers(layer))

    def row_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of :meth:`row_buffers` holding ``slots`` (int64, any shape); the same for
        every layer and buffer."""
        return slot_index(self.k_caches[0], slots)

    def flat_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``layer_major`` only: layer ``layer``'s caches viewed as slots ``[num_blocks *
        block_size, width]`` (row ``s`` is slot ``s``).

        Raises:
            ValueError: a ``block_major`` cache (no such view: use :meth:`row_buffers` with
                :meth:`row_index`, or :meth:`read`).
        """
        if self.layout != "layer_major":
            raise ValueError(f"a {self.layout} KV cache has no slot-indexed view: index "
                             "row_buffers(layer) with row_index(slots), or read(layer, slots)")
        return self.row_buffers(layer)

    def flat_k(self, layer: int) -> torch.Tensor:
        """``layer_major`` only: layer ``layer``'s K as slots (:meth:`flat_buffers`)."""
        return self.flat_buffers(layer)[0]

    def flat_v(self, layer: int) -> torch.Tensor:
        """``layer_major`` only: layer ``layer``'s V as slots (:meth:`flat_buffers`)."""
        return self.flat_buffers(layer)[1]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of layer ``layer``'s rows at ``slots`` (int64 ``[T]``): ``[T, width]`` per
        buffer, in ``buffer_names`` order (checks and tests; the model indexes in place)."""
        rows = self.row_index(slots)
        return tuple(buf.index_select(0, rows) for buf in self.row_buffers(layer))

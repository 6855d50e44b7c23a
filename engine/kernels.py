"""Kernel registry: kernel name -> implementation, per platform, imported lazily.

Model code never branches on the device: the runner resolves a :class:`KernelSet` once
(``KERNELS.resolve(platform.device_type, choices)``) and hands it to the model. Each entry is
registered with a loader (a zero-argument function returning the callable) so that e.g.
``torch_npu`` is imported only when the NPU implementation is resolved.

Kernels:
    reshape_and_cache(entries, caches, slot_mapping): write each of a layer's per-token
        entries (K ``[T, L]``, V ``[T, R]`` and, for V3.2, index_k ``[T, Di]``) into its paged
        cache ``[num_blocks, block_size, width]`` at flat slots ``[T]``: ONE call per layer
        per step, one write per buffer (vLLM's ``reshape_and_cache`` contract, plus the
        indexer cache).
    mla_decode(q_nope, q_pe, k_cache, v_cache, decode_batch, w_uk, w_uv, scale): decode
        attention of B single-token sequences over the paged caches, read through the
        batch's block table (see :func:`engine.mla_ops.decode_absorbed`); variants
        "absorbed" (default, tiled, every device), "naive" (MHA form over a padded copy, the
        reference), "flashinfer" (cuda only) and "npu" (npu only): the device variants
        (:mod:`engine.mla_device`) are UNTESTED off-device and not the default.
    sparse_decode(q_nope, q_pe, k_cache, v_cache, selection, w_uk, w_uv, scale):
        DeepSeek-V3.2 decode attention, each query over its own selected slots
        (``selection.slots [Q, K]``, a :class:`engine.forward_context.SlotSelection`);
        variant "absorbed" (:func:`engine.mla_ops.attend_selected_absorbed`).
    sparse_prefill(q_nope, q_pe, k_cache, v_cache, selection, w_uk, w_uv, scale): DeepSeek-V3.2
        prefill attention, each query over its own selected slots (same contract as
        sparse_decode); variants "mha" (default, MHA form:
        :func:`engine.sparse_attention.sparse_prefill_mha`) and "absorbed"
        (:func:`engine.mla_ops.attend_selected_absorbed`).
    w8a8_linear(x, weight, weight_scale): int8 linear with per-token dynamic activation
        quantization (:func:`engine.quant.w8a8.w8a8_linear`).
    w8a8_mlp(x, gate_up_weight, gate_up_scale, down_weight, down_scale): the fused int8
        SwiGLU MLP of an expert (:func:`engine.quant.w8a8.w8a8_mlp`).
    lm_head(weight): a factory, called once after loading, of the vocabulary GEMM
        ``hidden [R, H] -> [R, V]`` over ``weight [V, H]`` (:mod:`engine.lm_head_gemm`);
        variants "native" (cpu: oneDNN over a packed copy from 2 rows, cuda/npu:
        ``F.linear``) and "torch" (``F.linear`` everywhere).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch


Loader = Callable[[], Callable]


@dataclass(frozen=True)
class KernelSet:
    """Resolved kernels for one platform; passed to the model (no globals looked up later)."""

    reshape_and_cache: Callable
    mla_decode: Callable
    sparse_decode: Callable
    sparse_prefill: Callable
    w8a8_linear: Callable
    w8a8_mlp: Callable
    lm_head: Callable


class KernelRegistry:
    """``(kernel name, variant) -> {device_type: loader}``, plus a default variant per name."""

    def __init__(self) -> None:
        self._impls: dict[tuple[str, str], dict[str, Loader]] = {}
        self._defaults: dict[str, str] = {}

    def register(self, name: str, variant: str, device_types: tuple[str, ...],
                 loader: Loader, *, default: bool = False) -> None:
        """Register ``loader`` as ``name``/``variant`` on each of ``device_types``."""
        table = self._impls.setdefault((name, variant), {})
        for device_type in device_types:
            table[device_type] = loader
        if default or name not in self._defaults:
            self._defaults[name] = variant

    def variants(self, name: str) -> list[str]:
        """Registered variants of kernel ``name``."""
        return sorted(v for (n, v) in self._impls if n == name)

    def get(self, name: str, device_type: str, variant: str | None = None) -> Callable:
        """The implementation of ``name`` (``variant`` or the default) on ``device_type``.

        Raises:
            KeyError: unknown kernel, variant or device type; the message lists what exists.
        """
        variant = variant or self._defaults.get(name)
        table = self._impls.get((name, variant))
        if table is None:
            raise KeyError(f"kernel {name!r} has no variant {variant!r}; registered: "
                           f"{self.variants(name)}")
        if device_type not in table:
            raise KeyError(f"kernel {name}/{variant} has no {device_type!r} implementation; "
                           f"available on {sorted(table)}")
        return table[device_type]()

    def resolve(self, device_type: str, choices: Mapping[str, str] | None = None) -> KernelSet:
        """Resolve every kernel of :class:`KernelSet`; ``choices`` maps name -> variant."""
        choices = dict(choices or {})
        unknown = set(choices) - {f.name for f in fields(KernelSet)}
        if unknown:
            raise KeyError(f"unknown kernels {sorted(unknown)}; known: "
                           f"{[f.name for f in fields(KernelSet)]}")
        return KernelSet(**{f.name: self.get(f.name, device_type, choices.get(f.name))
                            for f in fields(KernelSet)})


def reshape_and_cache_torch(entries: tuple[torch.Tensor, ...], caches: tuple[torch.Tensor, ...],
                            slot_mapping: torch.Tensor) -> None:
    """CPU/CUDA: one ``index_copy_`` per buffer into the cache viewed ``[slots, width]``.

    Args:
        entries: per-token rows ``[T, width_i]`` in ``KVCacheSpec.buffer_names`` order.
        caches: the layer's caches ``[num_blocks, block_size, width_i]``, same order.
        slot_mapping: ``[T]`` int64 flat slots.
    """
    for entry, cache in zip(entries, caches, strict=True):
        cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, entry.to(cache.dtype))


def _load_npu_reshape_and_cache() -> Callable:
    """NPU: ``torch_npu._npu_reshape_and_cache`` (vLLM-Ascend's call) for K and V, the
    indexer keys (V3.2) with ``torch_npu.npu_scatter_nd_update_``; untested off-Ascend."""
    import torch_npu  # noqa: PLC0415 (lazy: only on Ascend)

    def reshape_and_cache_npu(entries, caches, slot_mapping):
        # NOTE: the op takes per-head tensors [T, 1, L] / caches [blocks, bs, 1, L], int32 slots.
        (k, v, *index_k), (k_cache, v_cache, *index_cache) = entries, caches
        torch_npu._npu_reshape_and_cache(
            key=k.unsqueeze(1), value=v.unsqueeze(1), key_cache=k_cache.unsqueeze(2),
            value_cache=v_cache.unsqueeze(2), slot_indices=slot_mapping.to(torch.int32))
        for entry, cache in zip(index_k, index_cache, strict=True):
            torch_npu.npu_scatter_nd_update_(cache.view(-1, cache.shape[-1]),
                                             slot_mapping.view(-1, 1), entry.to(cache.dtype))

    return reshape_and_cache_npu


def _load_op(module: str, name: str, *, call: bool = False) -> Loader:
    """Loader of ``module.name``; with ``call``, of what that zero-argument factory returns
    (a kernel that imports its library or keeps per-runner state when built)."""
    def load() -> Callable:
        import importlib  # noqa: PLC0415 (lazy like every loader)

        op = getattr(importlib.import_module(module), name)
        return op() if call else op

    return load


def _load_npu_w8a8_op(name: str) -> Loader:
    def load() -> Callable:
        from engine.quant import npu  # noqa: PLC0415 (imports torch_npu)

        return getattr(npu, f"load_{name}")()

    return load


KERNELS = KernelRegistry()
"""The registry every runner resolves from (filled once, here, at import)."""

KERNELS.register("reshape_and_cache", "native", ("cpu", "cuda"),
                 lambda: reshape_and_cache_torch, default=True)
KERNELS.register("reshape_and_cache", "native", ("npu",), _load_npu_reshape_and_cache)
_ALL = ("cpu", "cuda", "npu")
KERNELS.register("mla_decode", "absorbed", _ALL, _load_op("engine.mla_ops", "decode_absorbed"),
                 default=True)
KERNELS.register("mla_decode", "naive", _ALL, _load_op("engine.mla_ops", "decode_naive"))
KERNELS.register("mla_decode", "flashinfer", ("cuda",),
                 _load_op("engine.mla_device", "load_flashinfer_decode", call=True))
KERNELS.register("mla_decode", "npu", ("npu",),
                 _load_op("engine.mla_device", "load_npu_decode", call=True))
KERNELS.register("sparse_decode", "absorbed", _ALL,
                 _load_op("engine.mla_ops", "attend_selected_absorbed"), default=True)
KERNELS.register("sparse_prefill", "mha", _ALL,
                 _load_op("engine.sparse_attention", "sparse_prefill_mha"), default=True)
KERNELS.register("sparse_prefill", "absorbed", _ALL,
                 _load_op("engine.mla_ops", "attend_selected_absorbed"))
for _op in ("w8a8_linear", "w8a8_mlp"):
    KERNELS.register(_op, "native", ("cpu", "cuda"), _load_op("engine.quant.w8a8", _op),
                     default=True)
    KERNELS.register(_op, "native", ("npu",), _load_npu_w8a8_op(_op))
KERNELS.register("lm_head", "native", ("cpu",), _load_op("engine.lm_head_gemm", "onednn_lm_head"),
                 default=True)
KERNELS.register("lm_head", "native", ("cuda", "npu"),
                 _load_op("engine.lm_head_gemm", "torch_lm_head"))
KERNELS.register("lm_head", "torch", _ALL, _load_op("engine.lm_head_gemm", "torch_lm_head"))

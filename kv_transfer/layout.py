"""KV layout of one instance: what the bytes of a cache slot mean, and its fingerprint.

A layout names, per layer, the cache buffers (``k`` and ``v``; DSA adds ``index_k``, the
lightning indexer's keys, on the layers with an indexer: all of V3.2's, GLM-5.2's full layers
only, :attr:`BufferSpec.layers`), their per-token dims for the whole model, the dtype, block
size, layer count, tp size, rope layout and model identity. A record carries, for each of its
layers, only the buffers that layer has.

What must match between a prefill and a decode instance (``check_compatible``), and why:

- ``model``: the bytes are activations of one model's weights.
- ``kind`` (mla/gqa), ``buffers`` (names, per-token dims and which layers have each),
  ``num_kv_heads``: the shape of a
  token's bytes; a mismatch would scatter garbage (a V3 layout has two buffers, a V3.2 one
  three: the records would not even have the same number of messages).
- ``dtype``: no conversion happens on the wire.
- ``num_layers``: every layer is moved.
- ``rope_layout``: interleaved vs de-interleaved k_pe (REFERENCE.md "Rope layout") give
  different bytes for the same key.
- ``layer_specs`` (DeepSeek-V4 only): the per-layer-kind KV specs the staging rows pack
  (:func:`engine.v4.staging.layout_text`): the rows mean nothing under other specs.

What may differ: ``tp`` (the transfer plan maps ranks and regroups GQA heads) and
``block_size`` (every transfer carries one destination slot per token). So the
``fingerprint`` hashes exactly the fields that must match; it is the same on every rank.

MLA caches are identical on every TP rank (the latent has no head axis). GQA caches hold the
heads of :func:`rank_heads` on each rank: ``[num_blocks, block_size, kv_heads/tp, head_dim]``
(heads replicated when tp > kv_heads).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer.errors import LayoutMismatchError

KINDS = ("mla", "gqa")
# Fields that must match for two instances to exchange KV bytes (see module docstring).
COMPATIBLE_FIELDS = ("model", "kind", "buffers", "num_kv_heads", "dtype", "num_layers",
                     "rope_layout", "mtp_layers", "layer_specs")
# NOTE: mtp_layers and layer_specs are in the dict (and the fingerprint) only when set:
# layouts without MTP / DeepSeek-V4 keep the fingerprint they had before those existed.


def rank_heads(tp: int, num_kv_heads: int, rank: int) -> range:
    """Global KV heads held by ``rank`` of a GQA instance of size ``tp``.

    tp <= heads: contiguous ``heads/tp`` heads; tp > heads: one head, replicated on
    ``tp/heads`` consecutive ranks (vLLM's KV head replication).

    Raises:
        ValueError: neither ``heads % tp == 0`` nor ``tp % heads == 0``, or bad rank.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tp {tp}")
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over tp {tp}: "
                             "choose a tp that divides the head count")
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise ValueError(f"tp {tp} is not a multiple of {num_kv_heads} KV heads: choose a tp "
                         "that divides or is a multiple of the head count")
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class BufferSpec:
    """One cache buffer per layer.

    Attributes:
        name: ``k``, ``v`` or ``index_k`` (``KVCacheSpec.buffer_names``).
        dims: per-token dims for the whole model: MLA ``(kv_lora_rank,)`` / ``(rope_dim,)`` /
            ``(index_head_dim,)``, GQA ``(num_kv_heads, head_dim)``.
        layers: the layers that have it, ascending; None = every layer (GLM-5.2's
            ``index_k``: the full indexer layers only).
    """

    name: str
    dims: tuple[int, ...]
    layers: tuple[int, ...] | None = None

    def in_layers(self, layers: tuple[int, ...]) -> tuple[int, ...]:
        """Those of ``layers`` that have this buffer, in their order."""
        return layers if self.layers is None else tuple(i for i in layers if i in self.layers)


@dataclass(frozen=True)
class KVLayout:
    """Layout of one instance's KV cache (see module docstring for what must match).

    Attributes:
        model: model identity (e.g. checkpoint name + revision).
        kind: ``mla`` or ``gqa``.
        buffers: the per-layer buffers in cache order (K, V[, index_k]); the wire sends one
            payload per buffer in this order.
        num_kv_heads: GQA KV heads of the whole model; None for MLA.
        dtype: element dtype name, e.g. ``bfloat16``.
        num_layers: layers with a cache.
        block_size: tokens per block (may differ between instances).
        tp: tensor-parallel size of the instance (may differ between instances).
        rope_layout: ``interleaved`` or ``deinterleaved`` k_pe.
        mtp_layers: how many of the last layers are MTP module caches (speculative
            decoding; 0: none).
        layer_specs: DeepSeek-V4: the canonical text of its per-layer KV specs
            (:func:`engine.v4.staging.layout_text`); "" for every other model.
    """

    model: str
    kind: str
    buffers: tuple[BufferSpec, ...]
    num_kv_heads: int | None
    dtype: str
    num_layers: int
    block_size: int
    tp: int
    rope_layout: str
    mtp_layers: int = 0
    layer_specs: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KVLayout.kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "gqa") != (self.num_kv_heads is not None):
            raise ValueError("KVLayout.num_kv_heads is required for gqa and must be None for mla")
        if min(self.num_layers, self.block_size, self.tp) <= 0:
            raise ValueError("KVLayout num_layers, block_size and tp must be positive")
        if self.kind == "gqa":
            rank_heads(self.tp, self.num_kv_heads, 0)  # validates the head split
        for b in self.buffers:
            if b.layers is not None and (list(b.layers) != sorted(set(b.layers)) or not b.layers
                                         or not 0 <= b.layers[0] <= b.layers[-1]
                                         < self.num_layers):
                raise ValueError(f"KVLayout buffer {b.name} layers {b.layers} must be distinct, "
                                 f"ascending and within 0..{self.num_layers - 1}")

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, model: str, tp: int) -> KVLayout:
        """MLA layout of a :class:`KVCacheSpec` for an instance of ``tp``: one buffer per
        tensor of its layer specs (:meth:`KVCacheSpec.buffers`: K = latent, V = k_pe, index_k =
        DSA indexer keys), naming its layers only when some layers lack it (GLM-5.2)."""
        buffers = tuple(BufferSpec(name, (width,), None if len(layers) == spec.num_layers
                                   else layers)
                        for name, (width, layers) in spec.buffers().items())
        return cls(model=model, kind="mla", buffers=buffers,
                   num_kv_heads=None, dtype=_dtype_name(spec.dtype), num_layers=spec.num_layers,
                   block_size=spec.block_size, tp=tp, rope_layout=spec.rope_layout,
                   mtp_layers=spec.mtp_layers)

    @classmethod
    def gqa(cls, model: str, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
            dtype: torch.dtype, tp: int, rope_layout: str = "neox") -> KVLayout:
        """GQA layout: K and V ``[num_blocks, block_size, kv_heads/tp, head_dim]`` per rank."""
        dims = (num_kv_heads, head_dim)
        return cls(model=model, kind="gqa", buffers=(BufferSpec("k", dims), BufferSpec("v", dims)),
                   num_kv_heads=num_kv_heads, dtype=_dtype_name(dtype), num_layers=num_layers,
                   block_size=block_size, tp=tp, rope_layout=rope_layout)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return torch.empty((), dtype=self.torch_dtype).element_size()

    def heads_of(self, rank: int) -> range | None:
        """Global KV heads held by ``rank`` (None for MLA: no head axis)."""
        return None if self.kind == "mla" else rank_heads(self.tp, self.num_kv_heads, rank)

    def token_dims(self, buffer: BufferSpec, heads: range | None) -> tuple[int, ...]:
        """Per-token dims of ``buffer`` restricted to ``heads`` (all dims for MLA)."""
        return buffer.dims if heads is None else (len(heads),) + buffer.dims[1:]

    def layer_buffers(self, layer: int) -> tuple[BufferSpec, ...]:
        """The buffers layer ``layer`` has, in cache order (``KVCache.layer_buffers``)."""
        return tuple(b for b in self.buffers if b.layers is None or layer in b.layers)

    def token_layer_bytes(self, layers: tuple[int, ...], heads: range | None) -> int:
        """Bytes of one token over ``layers``, each with the buffers it has, for ``heads``."""
        return sum(len(b.in_layers(layers)) * math.prod(self.token_dims(b, heads))
                   for b in self.buffers) * self.element_size

    def to_dict(self) -> dict:
        """Plain dict (msgpack/json safe); inverse of :meth:`from_dict`."""
        return {"model": self.model, "kind": self.kind,
                "buffers": [[b.name, list(b.dims)] + ([] if b.layers is None else [list(b.layers)])
                            for b in self.buffers],
                "num_kv_heads": self.num_kv_heads, "dtype": self.dtype,
                "num_layers": self.num_layers, "block_size": self.block_size, "tp": self.tp,
                "rope_layout": self.rope_layout} | (
                    {"mtp_layers": self.mtp_layers} if self.mtp_layers else {}) | (
                    {"layer_specs": self.layer_specs} if self.layer_specs else {})

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        """Rebuild a layout sent by a peer. Raises ValueError/KeyError on a malformed dict."""
        fields = dict(data)
        fields["buffers"] = tuple(
            BufferSpec(str(b[0]), tuple(int(x) for x in b[1]),
                       tuple(int(x) for x in b[2]) if len(b) > 2 else None)
            for b in data["buffers"])
        return cls(**fields)

    def fingerprint(self) -> str:
        """Stable 16-hex-digit hash of the fields that must match (``COMPATIBLE_FIELDS``)."""
        full = self.to_dict()
        canon = json.dumps({k: full[k] for k in COMPATIBLE_FIELDS if k in full}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`LayoutMismatchError` naming every differing field with both values;
        ``self`` is the prefill side's layout, ``other`` the decode side's.

        Example message: ``"KV layouts differ: dtype: prefill float32 vs decode bfloat16"``.
        """
        prefill, decode = self.to_dict(), other.to_dict()
        diffs = [f"{k}: prefill {_show(prefill.get(k, 0))} vs decode {_show(decode.get(k, 0))}"
                 for k in COMPATIBLE_FIELDS if prefill.get(k, 0) != decode.get(k, 0)]
        if diffs:
            raise LayoutMismatchError(
                "KV layouts differ: " + "; ".join(diffs) + _buffer_hint(self, other)
                + _mtp_hint(self, other) + _v4_hint(self, other)
                + ". Prefill and decode must serve the same model with the same KV cache "
                "dtype, dims, layer count and rope layout: fix the instance configs.")


def _buffer_hint(prefill: KVLayout, decode: KVLayout) -> str:
    """A sentence for the sparse-vs-dense case: one side caches indexer keys, the other not."""
    names = [{b.name for b in lay.buffers} for lay in (prefill, decode)]
    has = ["index_k" in n for n in names]
    if has[0] == has[1]:
        return ""
    sparse, dense = ("prefill", "decode") if has[0] else ("decode", "prefill")
    return (f" ({sparse} caches DeepSeek-V3.2 indexer keys (index_k, DSA sparse attention as "
            f"GLM-5's), "
            f"{dense} does not: both must serve the same model)")


def _mtp_hint(prefill: KVLayout, decode: KVLayout) -> str:
    """A sentence for the MTP-vs-none case: one side caches the MTP module's KV."""
    if prefill.mtp_layers == decode.mtp_layers:
        return ""
    with_mtp, without = ("prefill", "decode") if prefill.mtp_layers else ("decode", "prefill")
    return (f" ({with_mtp} runs MTP speculative decoding and caches the MTP module's KV, "
            f"{without} does not: give both the same decode.speculative setting)")


def _v4_hint(prefill: KVLayout, decode: KVLayout) -> str:
    """A sentence for a DeepSeek-V4 side whose per-layer specs differ from the other's."""
    if prefill.layer_specs == decode.layer_specs:
        return ""
    if prefill.layer_specs and decode.layer_specs:
        return (" (both serve DeepSeek-V4 but with different per-layer KV specs: window, "
                "compress ratios, layer_types or widths differ: load the same config.json)")
    v4, other = ("prefill", "decode") if prefill.layer_specs else ("decode", "prefill")
    return (f" ({v4} serves DeepSeek-V4 (per-layer staged state), {other} does not: both "
            "must serve the same model)")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _show(value: object) -> str:
    return str(value) if not isinstance(value, list) else json.dumps(value)

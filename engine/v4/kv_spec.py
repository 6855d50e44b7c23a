"""What one DeepSeek-V4 layer caches, one frozen spec per layer kind (DESIGN.md "Per-layer KV
specs"; the role vLLM's hybrid KV cache groups play).

Every V4 layer keeps a sliding window of raw K=V (``head_dim`` per token, shared by all heads).
A compressed layer (CSA, ratio 4; HCA, ratio 128) also keeps one compressed entry per
``compress_ratio`` tokens, and the compressor's partial state: the projected kv / gate of the
tokens since the last full group (< ratio of them) and, for CSA, whose entries pool two
overlapping groups, the previous group's first half (``overlap``). A CSA layer's lightning
indexer keeps its own compressed keys (``index_head_dim`` per entry) and compressor state.

A block pool, reservation, transfer plan or memory plan reads :class:`V4LayerSpec` (a
:class:`engine.kv_layer_spec.LayerKVSpec`, the vocabulary MLA layers share): which tensors, how
wide per token / entry / request, how many of each a request of ``n`` tokens holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_layer_spec import (PER_ENTRY, PER_REQUEST, PER_TOKEN, CachedTensor,
                                  LayerKVSpec)
from engine.v4.config import CSA, SLIDING, V4Config


@dataclass(frozen=True)
class V4LayerSpec(LayerKVSpec):
    """The cache of one V4 layer kind (``sliding_attention``, ``compressed_sparse_attention``
    or ``heavily_compressed_attention``).

    Attributes:
        kind: the ``layer_types`` value. head_dim: raw / compressed K=V width.
        sliding_window: tokens a query sees (itself included); the cache holds the last
            ``sliding_window - 1`` between steps. compress_ratio: tokens per entry (0: none).
        overlap: entries pool ``2 * compress_ratio`` tokens (CSA): the state keeps the last
            full group's first-half kv / gate. index_head_dim: indexer key width (0: none).
        index_topk: compressed entries a query attends to, the indexer's top-k (CSA); 0:
            every entry (HCA).
    """

    kind: str
    head_dim: int
    sliding_window: int
    compress_ratio: int
    overlap: bool
    index_head_dim: int
    index_topk: int = 0

    @property
    def kept_tokens(self) -> int:  # type: ignore[override]
        """``sliding_window - 1``: the window's raw K=V kept between steps."""
        return self.sliding_window - 1

    @property
    def entry_tokens(self) -> int:  # type: ignore[override]
        """``compress_ratio`` (0: a sliding layer, no entries)."""
        return self.compress_ratio

    def tensors(self) -> tuple[CachedTensor, ...]:
        """Every tensor this kind caches (widths in elements)."""
        out = [CachedTensor("window_kv", self.head_dim, PER_TOKEN)]
        if self.compress_ratio:
            out += [CachedTensor("compressed_kv", self.head_dim, PER_ENTRY),
                    *self._state("compressor", self.head_dim)]
        if self.index_head_dim:
            out += [CachedTensor("index_keys", self.index_head_dim, PER_ENTRY),
                    *self._state("indexer", self.index_head_dim)]
        return tuple(out)

    def _state(self, prefix: str, width: int) -> list[CachedTensor]:
        coff = 2 if self.overlap else 1  # NOTE: CSA projects two series (Ca | Cb) per token
        rows = self.compress_ratio - 1
        out = [CachedTensor(f"{prefix}_buffer_{t}", coff * width, PER_REQUEST, rows)
               for t in ("kv", "gate")]
        if self.overlap:
            out += [CachedTensor(f"{prefix}_overlap_{t}", width, PER_REQUEST,
                                 self.compress_ratio) for t in ("kv", "gate")]
        return out

    def rows(self, tensor: CachedTensor, num_tokens: int) -> int:
        """Rows of ``tensor`` one request holds after ``num_tokens`` tokens."""
        if tensor.per == PER_TOKEN:
            return min(num_tokens, self.sliding_window - 1)
        if tensor.per == PER_ENTRY:
            return num_tokens // self.compress_ratio
        if "_buffer_" in tensor.name:
            return num_tokens % self.compress_ratio
        return tensor.rows if num_tokens >= self.compress_ratio else 0  # overlap: once a group

    def read_rows(self, tensor: CachedTensor, context: float) -> float:
        """Rows of ``tensor`` one decode step reads at ``context`` tokens: the window's
        ``min(context, sliding_window)`` raw K=V, the compressed entries (``context / ratio``;
        CSA: the indexer's top ``index_topk`` of them), every index key (the indexer scores
        them all).

        NOTE: the compressor state is not counted: it is read and rewritten only as a group
        closes, at most ``compress_ratio`` rows of one request."""
        if tensor.per == PER_TOKEN:
            return min(context, self.sliding_window)
        if tensor.per == PER_REQUEST:
            return 0.0
        entries = context / self.compress_ratio
        if self.index_topk and tensor.name == "compressed_kv":
            return min(entries, self.index_topk)
        return entries


def kv_specs(config: V4Config) -> dict[str, V4LayerSpec]:
    """One :class:`V4LayerSpec` per layer kind present in ``config.layer_types``."""
    specs = {}
    for layer, kind in enumerate(config.layer_types):
        specs[kind] = V4LayerSpec(
            kind=kind, head_dim=config.head_dim, sliding_window=config.sliding_window,
            compress_ratio=config.compress_ratio(layer), overlap=kind == CSA,
            index_head_dim=config.index_head_dim if kind == CSA else 0,
            index_topk=config.index_topk if kind == CSA else 0)
    return specs


def layer_specs(config: V4Config) -> tuple[V4LayerSpec, ...]:
    """Layer i's spec (the per-kind objects of :func:`kv_specs`, shared)."""
    specs = kv_specs(config)
    return tuple(specs[kind] for kind in config.layer_types)


__all__ = ["CachedTensor", "LayerKVSpec", "PER_ENTRY", "PER_REQUEST", "PER_TOKEN", "SLIDING",
           "V4LayerSpec", "kv_specs", "layer_specs"]

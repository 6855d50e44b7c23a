"""What one layer caches, for every model family: one frozen spec per layer kind (DESIGN.md
"Per-layer KV specs"; the role vLLM's per-layer KV cache specs and hybrid groups play).

A :class:`LayerKVSpec` lists the layer's :class:`CachedTensor`s (elements per row, and whether a
request holds one row per token, per compressed entry or a fixed number per request) and says
how many rows of each a request of ``n`` tokens holds. Kinds:

- :class:`MLALayerSpec` (DeepSeek-V2/V3, V3.2, GLM-5): a full-attention MLA layer caches, for
  every token, ``k`` = the normalized latent ``c_kv`` (``kv_lora_rank``), ``v`` = the roped
  shared key ``k_pe`` (``qk_rope_head_dim``) and, on a DSA layer with its own lightning
  indexer, ``index_k`` (``index_head_dim``). :func:`mla_layer_specs` gives one per layer of a
  :class:`engine.model_config.ModelConfig`, MTP layers after the decoder layers.
- DeepSeek-V4's sliding / CSA / HCA layers: :class:`engine.v4.kv_spec.V4LayerSpec`.

:func:`held_elements` / :func:`held_bytes` are the one answer to "what does a request of ``n``
tokens hold in layers ``L``" for every family (the MLA cache spec's bytes per token, the memory
plans and the planner's KV bytes read them); :func:`read_bytes` answers "what does one decode
step read for a sequence of ``n`` tokens" (the planner's decode KV traffic).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.model_config import ModelConfig

PER_TOKEN, PER_ENTRY, PER_REQUEST = "token", "entry", "request"
MLA, MLA_INDEXER = "mla", "mla_indexer"


@dataclass(frozen=True)
class CachedTensor:
    """One cached tensor of a layer kind.

    Attributes:
        name: MLA: ``k``, ``v``, ``index_k`` (the paged cache's buffer names). V4:
            ``window_kv``, ``compressed_kv``, ``index_keys``, ``{compressor,indexer}_{buffer,
            overlap}_{kv,gate}``.
        width: elements per row. per: rows per token (``token``), per compressed entry
            (``entry``) or a fixed row count per request (``request``).
        rows: for ``request`` tensors, the most rows held (state); 0 otherwise.
    """

    name: str
    width: int
    per: str
    rows: int = 0


class LayerKVSpec(ABC):
    """The cache of one layer kind: its tensors and how many rows of each a request holds.

    Subclasses are frozen dataclasses (hashable, compared by value); ``kind`` names the kind
    (MLA: ``mla`` / ``mla_indexer``; V4: the ``layer_types`` value).
    """

    kind: str

    @abstractmethod
    def tensors(self) -> tuple[CachedTensor, ...]:
        """Every tensor this kind caches, in cache order (widths in elements)."""

    @abstractmethod
    def rows(self, tensor: CachedTensor, num_tokens: int) -> int:
        """Rows of ``tensor`` one request holds after ``num_tokens`` tokens."""

    @abstractmethod
    def read_rows(self, tensor: CachedTensor, context: float) -> float:
        """Rows of ``tensor`` one decode step reads for a query whose sequence has ``context``
        tokens, itself included (a float: the planner's mean context; compressed entries
        counted as ``context / ratio``, not floored)."""

    def elements(self, num_tokens: int) -> int:
        """Elements held by one request of ``num_tokens`` tokens in one layer of this kind."""
        return sum(self.rows(t, num_tokens) * t.width for t in self.tensors())

    @property
    def kept_tokens(self) -> int:
        """Tokens whose ``token`` rows a request keeps between steps, the last ones (a sliding
        window); 0: every token's (full attention)."""
        return 0

    @property
    def entry_tokens(self) -> int:
        """Tokens per ``entry`` row (the compression ratio); 0: no ``entry`` tensors."""
        return 0


@dataclass(frozen=True)
class MLALayerSpec(LayerKVSpec):
    """A full-attention MLA layer (DeepSeek-V3 ``inference/model.py`` ``MLA``: the cache holds
    ``kv_cache`` = c_kv and ``pe_cache`` = k_pe of every token; V3.2's ``Indexer`` adds its
    keys). Every tensor has one row per token, all tokens kept.

    Attributes:
        kv_lora_rank: ``k`` (c_kv) width. qk_rope_head_dim: ``v`` (k_pe) width.
        index_head_dim: ``index_k`` width; 0: no indexer cache (V3, GLM-5.2's shared layers).
        index_topk: DSA's ``index_topk``: a query attends to at most this many tokens'
            ``k`` / ``v`` rows (GLM-5.2's shared layers too, by the last indexer's
            selection); 0: dense attention over every token (V3).
    """

    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def kind(self) -> str:  # type: ignore[override]
        """``mla_indexer`` with an index_k tensor, else ``mla``."""
        return MLA_INDEXER if self.index_head_dim else MLA

    def tensors(self) -> tuple[CachedTensor, ...]:
        """``k``, ``v`` and, with an indexer, ``index_k``: all per token."""
        return _mla_tensors(self.kv_lora_rank, self.qk_rope_head_dim, self.index_head_dim)

    def rows(self, tensor: CachedTensor, num_tokens: int) -> int:
        """``num_tokens``: every token keeps its row."""
        return num_tokens

    def read_rows(self, tensor: CachedTensor, context: float) -> float:
        """``k`` / ``v``: every token's, or the top ``index_topk`` under DSA (absorbed
        attention over the selected latents); ``index_k``: every token's (the indexer scores
        the whole context)."""
        if self.index_topk and tensor.name != "index_k":
            return min(context, self.index_topk)
        return context


@lru_cache(maxsize=64)
def _mla_tensors(kv_lora_rank: int, qk_rope_head_dim: int,
                 index_head_dim: int) -> tuple[CachedTensor, ...]:
    # NOTE: built once per width triple: a send counts its bytes from these every chunk
    out = (CachedTensor("k", kv_lora_rank, PER_TOKEN),
           CachedTensor("v", qk_rope_head_dim, PER_TOKEN))
    if index_head_dim:
        out += (CachedTensor("index_k", index_head_dim, PER_TOKEN),)
    return out


def mla_layer_specs(config: ModelConfig, mtp_layers: int = 0) -> tuple[MLALayerSpec, ...]:
    """One :class:`MLALayerSpec` per layer of an MLA ``config``: its ``num_hidden_layers``
    decoder layers, then ``mtp_layers`` MTP layers; ``index_k`` where
    :meth:`~engine.model_config.ModelConfig.has_indexer` (every layer of V3.2, GLM-5.2's full
    layers, a DSA checkpoint's MTP layer); ``index_topk`` on every layer of a DSA model.
    Layers of one kind share one object."""
    specs = {flag: MLALayerSpec(config.kv_lora_rank, config.qk_rope_head_dim,
                                config.index_head_dim if flag else 0, config.index_topk)
             for flag in (False, True)}
    return tuple(specs[config.has_indexer(i)]
                 for i in range(config.num_hidden_layers + mtp_layers))


def held_elements(specs: Sequence[LayerKVSpec], num_tokens: int,
                  layers: Iterable[int] | None = None, names: Iterable[str] | None = None) -> int:
    """Elements one request of ``num_tokens`` tokens holds in ``layers`` (indices into
    ``specs``; default all), each with its tensors (only those in ``names`` when given).
    Example: V3 (512 + 64 per token, 61 layers), 1000 tokens: 61 x 576 x 1000."""
    wanted = None if names is None else set(names)
    return sum(spec.rows(t, num_tokens) * t.width
               for spec in (specs if layers is None else [specs[i] for i in layers])
               for t in spec.tensors() if wanted is None or t.name in wanted)


def held_bytes(specs: Sequence[LayerKVSpec], num_tokens: int, elem_bytes: float,
               layers: Iterable[int] | None = None) -> float:
    """Bytes one request of ``num_tokens`` tokens holds in ``layers`` (:func:`held_elements`
    x ``elem_bytes`` bytes per element): what PD ships for it, what it pins in the pools."""
    return held_elements(specs, num_tokens, layers) * elem_bytes


def read_bytes(specs: Sequence[LayerKVSpec], context: float, elem_bytes: float) -> float:
    """KV bytes one decode step reads for one sequence of ``context`` tokens (the query
    included), over every layer of ``specs``: each tensor's :meth:`LayerKVSpec.read_rows` x
    width x ``elem_bytes``. What the planner's decode step streams from HBM per sequence.
    Example: V3.2 (61 layers, top 2048 of 512 + 64, index keys 128 over every token), 4096
    tokens: 2 B x 61 x (2048 x 576 + 4096 x 128)."""
    return elem_bytes * sum(spec.read_rows(t, context) * t.width
                            for spec in specs for t in spec.tensors())


__all__ = ["CachedTensor", "LayerKVSpec", "MLA", "MLALayerSpec", "MLA_INDEXER", "PER_ENTRY",
           "PER_REQUEST", "PER_TOKEN", "held_bytes", "held_elements", "mla_layer_specs",
           "read_bytes"]

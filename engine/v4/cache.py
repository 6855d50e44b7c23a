"""A contiguous per-request DeepSeek-V4 cache, laid out by :mod:`engine.v4.kv_spec`.

NOTE: the reference layout (tensors grown by concatenation); :mod:`engine.v4.paged_cache`
gives the same interface over paged storage sized from the same
:class:`~engine.v4.kv_spec.V4LayerSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.v4.kv_spec import V4LayerSpec, layer_specs
from engine.v4.config import V4Config


@dataclass
class CompressorState:
    """One compressor's state (the attention's, or the indexer's at ``index_head_dim``).

    Attributes:
        entries: ``[E, d]`` compressed entries emitted so far (rope applied).
        buffer_kv, buffer_gate: ``[n, coff * d]`` projections of the ``n < ratio`` tokens
            since the last full group (gate includes ``position_bias``); None when empty.
        overlap_kv, overlap_gate: ``[ratio, d]`` first half (Ca) of the last full group (CSA
            only), None before the first group.
    """

    entries: torch.Tensor
    buffer_kv: torch.Tensor | None = None
    buffer_gate: torch.Tensor | None = None
    overlap_kv: torch.Tensor | None = None
    overlap_gate: torch.Tensor | None = None

    @property
    def num_entries(self) -> int:
        return self.entries.shape[0]

    @property
    def width(self) -> int:
        """Elements per entry (``d``)."""
        return self.entries.shape[1]

    def read_entries(self, first: int, last: int) -> torch.Tensor:
        """Entries ``[first, last)``, ``[last - first, d]``."""
        return self.entries[first:last]

    def append_entries(self, new: torch.Tensor) -> torch.Tensor:
        """Append ``new [n, d]`` entries; return all ``[E, d]``."""
        self.entries = torch.cat((self.entries, new))
        return self.entries


@dataclass
class LayerCache:
    """One layer's cache for one request.

    Attributes:
        spec: the layer kind's spec. window: ``[w, head_dim]`` raw K=V of the last
            ``w <= sliding_window - 1`` tokens. compressor / indexer: states or None.
    """

    spec: V4LayerSpec
    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def extend_window(self, kv: torch.Tensor) -> torch.Tensor:
        """Keys of the step: the window then the step's ``kv [T, D]`` -> ``[w + T, D]``; keep
        the last ``sliding_window - 1`` of them."""
        keys = torch.cat((self.window, kv))
        # NOTE: a clone, so the window does not keep the whole chunk's kv alive
        self.window = keys[max(keys.shape[0] - (self.spec.sliding_window - 1), 0):].clone()
        return keys


@dataclass
class V4Cache:
    """All layers' caches of one request; ``num_tokens`` tokens already processed."""

    layers: list[LayerCache]
    num_tokens: int = 0

    @classmethod
    def empty(cls, config: V4Config, dtype: torch.dtype, device: torch.device) -> V4Cache:
        """A cache with no tokens, one :class:`LayerCache` per layer."""
        layers = []
        for spec in layer_specs(config):
            def state(width: int) -> CompressorState:
                return CompressorState(torch.zeros(0, width, dtype=dtype, device=device))
            layers.append(LayerCache(
                spec, torch.zeros(0, spec.head_dim, dtype=dtype, device=device),
                state(spec.head_dim) if spec.compress_ratio else None,
                state(spec.index_head_dim) if spec.index_head_dim else None))
        return cls(layers)

    def reserve(self, num_tokens: int) -> None:
        """Make room for tokens up to ``num_tokens`` before a step (contiguous: nothing)."""

    def advance(self, num_new: int) -> None:
        """After a step: ``num_new`` more tokens are in the cache."""
        self.num_tokens += num_new

    def elements(self) -> int:
        """Elements held now, summed over layers and tensors (compare with
        :meth:`V4LayerSpec.elements`)."""
        total = 0
        for layer in self.layers:
            total += layer.window.numel()
            for state in (layer.compressor, layer.indexer):
                if state is None:
                    continue
                total += sum(t.numel() for t in (state.entries, state.buffer_kv,
                                                 state.buffer_gate, state.overlap_kv,
                                                 state.overlap_gate) if t is not None)
        return total

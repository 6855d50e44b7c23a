"""A DeepSeek-V4 request's shipped state as fixed-width rows: what the KV transfer moves
between a prefill and a decode instance (docs/kv_transfer.md "DeepSeek-V4").

The transfer moves ``[layers, rows, width]`` slot rows of a paged cache (one buffer per
layer, :mod:`kv_transfer.payload`). A V4 request's state after ``n`` tokens is, per layer,
the tensors :func:`engine.v4.state_io.export_request` gives (window, compressed entries,
indexer keys, compressor / indexer open-group state), of different widths and row counts.
Here each layer's tensors are laid end to end in spec order (:meth:`LayerKVSpec.tensors`),
flattened, zero-padded and cut into rows of :func:`row_width` elements: the layer's
``staged_rows`` rows. Every layer ships the same row count (the most any layer needs,
:func:`staged_rows`), so one record per layer carries the same token range, as for MLA.

Bound: every tensor holds at most ``n`` rows after ``n`` tokens (window ``min(n, W - 1)``,
entries ``n // r``, open group ``n % r``, overlap ``r`` once ``n >= r``), so a layer holds at
most ``n x sum(widths)`` elements and ``staged_rows(n) <= n``: the rows fit in the request's
prompt blocks on both sides (the scheduler's slots carry them; no second block pool).

The staging cache (:class:`StagingCache`, ``[num_blocks, block_size, row_width]`` per layer)
is allocated only by a PD role (:attr:`engine.v4.runner.V4Runner.kv_cache`); colocated
serving never touches it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.v4.config import V4Config
from engine.v4.kv_spec import kv_specs, layer_specs

STAGING_BUFFER = "v4_state"


def row_width(config: V4Config) -> int:
    """Elements per staging row: the widest layer kind's sum of tensor widths (one token's
    worth of every tensor of that kind)."""
    return max(sum(t.width for t in spec.tensors()) for spec in kv_specs(config).values())


def staged_rows(config: V4Config, num_tokens: int) -> int:
    """Rows every layer ships for a request after ``num_tokens`` (>= 1) tokens: the most any
    layer needs, at least 1, at most ``num_tokens`` (module docstring)."""
    width = row_width(config)
    need = max(math.ceil(spec.elements(num_tokens) / width)
               for spec in kv_specs(config).values())
    return max(1, need)


def layout_text(config: V4Config) -> str:
    """The V4 KV specs as a canonical string (the transfer layout's ``layer_specs``: two
    instances exchange rows only when it is equal): row width, window, per kind its ratio and
    tensors (name, width), and the layer schedule."""
    kinds = {kind: [spec.compress_ratio, [[t.name, t.width] for t in spec.tensors()]]
             for kind, spec in sorted(kv_specs(config).items())}
    return json.dumps({"row_width": row_width(config), "sliding_window": config.sliding_window,
                       "kinds": kinds, "layer_types": list(config.layer_types)},
                      sort_keys=True, separators=(",", ":"))


def pack(config: V4Config, layers: list[dict[str, torch.Tensor]], num_tokens: int,
         dtype: torch.dtype) -> torch.Tensor:
    """``[L, staged_rows(num_tokens), row_width]`` in ``dtype``: each layer's tensors
    (:func:`~engine.v4.state_io.export_request`'s dicts) in spec order, flattened, zero-padded.

    Raises:
        ValueError: a layer lacks a tensor its spec names.
    """
    rows, width = staged_rows(config, num_tokens), row_width(config)
    specs = layer_specs(config)
    device = layers[0]["window_kv"].device
    out = torch.zeros(len(specs), rows * width, dtype=dtype, device=device)
    for i, (spec, tensors) in enumerate(zip(specs, layers, strict=True)):
        missing = [t.name for t in spec.tensors() if t.name not in tensors]
        if missing:
            raise ValueError(f"layer {i} ({spec.kind}) lacks {missing} to stage")
        flat = torch.cat([tensors[t.name].reshape(-1).to(dtype) for t in spec.tensors()])
        out[i, :flat.numel()] = flat
    return out.view(len(specs), rows, width)


def unpack(config: V4Config, rows: torch.Tensor, num_tokens: int
           ) -> list[dict[str, torch.Tensor]]:
    """Inverse of :func:`pack`: ``rows [L, staged_rows(num_tokens), row_width]`` -> per layer
    ``{name: [spec.rows(t, num_tokens), width]}`` (views into ``rows``' copy).

    Raises:
        ValueError: ``rows`` is not ``[L, staged_rows(num_tokens), row_width]``.
    """
    specs = layer_specs(config)
    want = (len(specs), staged_rows(config, num_tokens), row_width(config))
    if tuple(rows.shape) != want:
        raise ValueError(f"staged rows {tuple(rows.shape)} for {num_tokens} tokens; the V4 "
                         f"specs give {want}")
    out = []
    for spec, layer in zip(specs, rows.reshape(len(specs), -1), strict=True):
        tensors, at = {}, 0
        for t in spec.tensors():
            count = spec.rows(t, num_tokens) * t.width
            tensors[t.name] = layer[at:at + count].view(-1, t.width)
            at += count
        out.append(tensors)
    return out


@dataclass(frozen=True)
class StagingSpec:
    """Shape of a :class:`StagingCache` (what the transfer's byte counts read).

    Attributes:
        num_layers: V4 decoder layers. num_blocks, block_size: the scheduler pool's.
        width: :func:`row_width`. dtype: the runner's.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    width: int
    dtype: torch.dtype

    buffer_names = (STAGING_BUFFER,)

    @property
    def buffer_widths(self) -> tuple[int, ...]:
        return (self.width,)

    def bytes_per_token_of(self, layers: Iterable[int]) -> int:
        """Bytes of one staging row over ``layers``."""
        return len(list(layers)) * self.width * torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.bytes_per_token_of((0,))


class StagingCache:
    """Per layer one contiguous ``[num_blocks, block_size, width]`` buffer (the transfer's
    ``layer_buffers`` interface); slot ``s`` is row ``s`` of the layer's flat view."""

    def __init__(self, spec: StagingSpec, device: torch.device | str = "cpu") -> None:
        self.spec, self.device = spec, torch.device(device)
        self.buffers = [torch.zeros(spec.num_blocks, spec.block_size, spec.width,
                                    dtype=spec.dtype, device=self.device)
                        for _ in range(spec.num_layers)]

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s one buffer ``[num_blocks, block_size, width]``."""
        return (self.buffers[layer],)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store ``rows [L, S, width]`` at ``slots`` (int64 ``[S]``) of every layer."""
        slots = slots.to(self.device)
        for buf, layer_rows in zip(self.buffers, rows, strict=True):
            buf.view(-1, self.spec.width).index_copy_(0, slots, layer_rows)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """``[L, S, width]`` copies of the rows at ``slots`` (int64 ``[S]``)."""
        slots = slots.to(self.device)
        return torch.stack([buf.view(-1, self.spec.width).index_select(0, slots)
                            for buf in self.buffers])

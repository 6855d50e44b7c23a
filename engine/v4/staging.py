"""A DeepSeek-V4 request's shipped state as fixed-width rows: what the KV transfer moves
between a prefill and a decode instance (docs/kv_transfer.md "DeepSeek-V4").

The transfer moves ``[layers, rows, width]`` slot rows of a paged cache (one buffer per
layer, :mod:`kv_transfer.payload`). A V4 request's state after ``n`` tokens is, per layer,
the tensors :func:`engine.v4.state_io.export_request` gives (window, compressed entries,
indexer keys, compressor / indexer open-group state), of different widths and row counts.
Each layer's tensors go into rows of its kind's width (:func:`kind_widths`: the sum of the
kind's tensor widths) as :mod:`engine.v4.row_layout` lays them out (entries first, then the
final window and the state, so rows become final chunk by chunk). A layer ships its kind's own
rows (``layer_rows(n)``; the decode tracker expects per layer that many of its ``[layers,
rows]`` cells), of its kind's width: a narrower kind (HCA, sliding) ships fewer, narrower
rows. A request's staging takes ``staged_rows(n)`` slots on each side (the most any layer
ships, ``<= n``: tested; :mod:`engine.v4.row_layout`); a layer's slots past its own rows stay
unused. A PD role's scheduler pool addresses the staging cache and holds only these slots
(``staging_blocks_for``; its size, ``V4Runner.scheduler_blocks``, is the role's
``v4_staging_blocks`` or ``num_kv_blocks``).

Buffers (:func:`tiers`): the kinds' widths sorted ascending cut a row into nested column
tiers: tier 0 (the narrowest kind's width) on every layer, tier ``j`` (the next width minus
the previous) on the layers of kinds at least that wide. So a layer's buffers are always the
first ones of the layout (what the transfer's buffer numbering assumes, as for GLM-5.2's
``index_k``), and each buffer is one contiguous ``[num_blocks, block_size, tier width]``
tensor per layer having it.

The staging cache (:class:`StagingCache`) is allocated only by a PD role
(:attr:`engine.v4.runner.V4Runner.kv_cache`); colocated serving never touches it. Its bytes:
:func:`staging_bytes` (what a memory plan counts for a PD rank).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.v4.config import V4Config
from engine.v4.kv_spec import kv_specs, layer_specs
from engine.v4.row_layout import (ROW_LAYOUT, kind_layout, layer_rows, most_staged_rows,
                                  pack_rows, staged_rows, unpack_rows)

STAGING_BUFFER = "v4_state"


def kind_widths(config: V4Config) -> dict[str, int]:
    """Per layer kind, the elements of one of its staging rows: the sum of its tensor widths
    (one token's worth of every tensor of that kind)."""
    return {kind: sum(t.width for t in spec.tensors())
            for kind, spec in kv_specs(config).items()}


def tiers(config: V4Config) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The staging buffers as (width, layers having it), in layout order: the kinds' distinct
    widths ascending, each tier the increment over the previous one, on every layer whose
    kind is at least that wide (module docstring)."""
    widths = kind_widths(config)
    cuts = sorted(set(widths.values()))
    out, below = [], 0
    for cut in cuts:
        layers = tuple(i for i, kind in enumerate(config.layer_types) if widths[kind] >= cut)
        out.append((cut - below, layers))
        below = cut
    return tuple(out)


def staging_bytes_per_slot(config: V4Config, dtype_bytes: int) -> int:
    """Bytes one staging slot holds over all layers: the sum over layers of their kind's width
    (:func:`kind_widths`) x ``dtype_bytes`` (the runner's dtype: 2 for bf16). Transformers'
    default V4 config: 146,944 elements (3.4x a V3.2 cache's 61 x 704 per token)."""
    widths = kind_widths(config)
    return sum(widths[kind] for kind in config.layer_types) * dtype_bytes


def staging_bytes(config: V4Config, num_blocks: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of a PD rank's staging cache (:class:`StagingCache`) of ``num_blocks`` blocks of
    ``block_size`` slots (``V4Runner.scheduler_blocks``: the role's ``v4_staging_blocks``, or
    ``num_kv_blocks`` when unset); 0 is never right for a PD role, colocated roles have none.
    What a memory plan adds on top of the V4 group pools for a PD rank."""
    return num_blocks * block_size * staging_bytes_per_slot(config, dtype_bytes)


def staging_blocks_for(config: V4Config, num_tokens: int, block_size: int) -> int:
    """Staging blocks one request of ``num_tokens`` prompt tokens holds (prefill until its
    rows are sent, decode until it ends): ``ceil(staged_rows / block_size)``, the widest
    kind's row count (a narrower layer leaves the rest of its slots unused); a staging pool
    of ``k`` x this holds ``k`` such requests in flight."""
    return -(-staged_rows(config, num_tokens) // block_size)


def most_staging_blocks(config: V4Config, max_tokens: int, block_size: int) -> tuple[int, int]:
    """The most :func:`staging_blocks_for` of any prompt of ``1 <= n <= max_tokens`` tokens
    and an ``n`` taking them (one with the most rows,
    :func:`engine.v4.row_layout.most_staged_rows`):
    the fewest blocks a role's staging pool (``v4_staging_blocks``) may have so that every
    request up to ``model.max_model_len`` fits it alone. Not ``staging_blocks_for(max_tokens)``:
    a shorter prompt can take more (its open compressor groups hold more state rows).

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    rows, num_tokens = most_staged_rows(config, max_tokens)
    return -(-rows // block_size), num_tokens


def layout_text(config: V4Config) -> str:
    """The V4 KV specs as a canonical string (the transfer layout's ``layer_specs``: two
    instances exchange rows only when it is equal): tier widths, window, per kind its ratio
    and tensors (name, width), the layer schedule, and the row layout's name
    (:mod:`engine.v4.row_layout`: another layout puts the same tensors in other rows)."""
    kinds = {kind: [spec.compress_ratio, [[t.name, t.width] for t in spec.tensors()]]
             for kind, spec in sorted(kv_specs(config).items())}
    return json.dumps({"tiers": [w for w, _ in tiers(config)],
                       "sliding_window": config.sliding_window,
                       "kinds": kinds, "layer_types": list(config.layer_types),
                       "rows": ROW_LAYOUT},
                      sort_keys=True, separators=(",", ":"))


def pack(config: V4Config, layers: list[dict[str, torch.Tensor]], num_tokens: int,
         dtype: torch.dtype, only: Collection[int] | None = None) -> list[torch.Tensor | None]:
    """Per layer all its own rows ``[layer_rows(num_tokens)[layer], kind width]`` in
    ``dtype``, from its tensors (:func:`~engine.v4.state_io.export_request`'s dicts) laid out
    by :mod:`engine.v4.row_layout`; with ``only``, None for the layers not in it.

    Raises:
        ValueError: a layer lacks a tensor its spec names.
    """
    out: list[torch.Tensor | None] = []
    for i, (spec, tensors, rows) in enumerate(zip(layer_specs(config), layers,
                                                   layer_rows(config, num_tokens), strict=True)):
        if only is not None and i not in only:
            out.append(None)
            continue
        missing = [t.name for t in spec.tensors() if t.name not in tensors]
        if missing:
            raise ValueError(f"layer {i} ({spec.kind}) lacks {missing} to stage")
        out.append(pack_rows(kind_layout(spec, num_tokens),
                             lambda name, a, b, tensors=tensors: tensors[name][a:b],
                             0, rows, dtype))
    return out


def unpack(config: V4Config, rows: list[torch.Tensor], num_tokens: int
           ) -> list[dict[str, torch.Tensor]]:
    """Inverse of :func:`pack`: per layer its own rows ``[layer_rows(num_tokens)[layer], kind
    width]`` -> per layer ``{name: [spec.rows(t, num_tokens), width]}`` (views into
    ``rows``).

    Raises:
        ValueError: a layer's rows are not ``[layer_rows(num_tokens)[layer], kind width]``.
    """
    widths = kind_widths(config)
    out = []
    for i, (spec, layer, want_rows) in enumerate(zip(layer_specs(config), rows,
                                                     layer_rows(config, num_tokens), strict=True)):
        want = (want_rows, widths[spec.kind])
        if tuple(layer.shape) != want:
            raise ValueError(f"layer {i}: staged rows {tuple(layer.shape)} for {num_tokens} "
                             f"tokens; the V4 specs give {want}")
        out.append(unpack_rows(spec, layer, num_tokens))
    return out


@dataclass(frozen=True)
class StagingSpec:
    """Shape of a :class:`StagingCache` (what the transfer's layout and byte counts read).

    Attributes:
        num_layers: V4 decoder layers. num_blocks, block_size: the scheduler pool's.
        tiers: :func:`tiers` (buffer widths and their layers). dtype: the runner's.
        layer_specs: :func:`layout_text` (the transfer layout's fingerprinted V4 specs).
    """

    num_layers: int
    num_blocks: int
    block_size: int
    tiers: tuple[tuple[int, tuple[int, ...]], ...]
    dtype: torch.dtype
    layer_specs: str = ""

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """``v4_state0``, ``v4_state1``, ...: one per tier."""
        return tuple(f"{STAGING_BUFFER}{j}" for j in range(len(self.tiers)))

    def layer_widths(self, layer: int) -> tuple[int, ...]:
        """Widths of layer ``layer``'s buffers (its tiers), in layout order."""
        return tuple(w for w, layers in self.tiers if layer in layers)

    def bytes_per_token_of(self, layers: Iterable[int]) -> int:
        """Bytes of one staging row over ``layers``."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(sum(self.layer_widths(i)) for i in layers) * elem

    @property
    def bytes_per_token_per_layer(self) -> int:
        """Mean bytes of one staging row per layer."""
        return self.bytes_per_token_of(range(self.num_layers)) // self.num_layers


class StagingCache:
    """Per layer one contiguous ``[num_blocks, block_size, tier width]`` buffer per tier it
    has (the transfer's ``layer_buffers`` interface); slot ``s`` is row ``s`` of each
    buffer's flat view, a layer's row is its tiers' columns side by side."""

    def __init__(self, spec: StagingSpec, device: torch.device | str = "cpu") -> None:
        self.spec, self.device = spec, torch.device(device)
        self.buffers = [tuple(torch.zeros(spec.num_blocks, spec.block_size, width,
                                          dtype=spec.dtype, device=self.device)
                              for width in spec.layer_widths(layer))
                        for layer in range(spec.num_layers)]

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s buffers ``[num_blocks, block_size, width]``, tier order."""
        return self.buffers[layer]

    def write(self, slots: torch.Tensor, rows: list[torch.Tensor | None]) -> None:
        """Store per layer ``rows[i] [S_i, its width]`` at ``slots[:S_i]`` (int64 ``[S]``,
        ``S_i <= S``: a layer's own rows); a None layer is left as it is."""
        slots = slots.to(self.device)
        for bufs, mine in zip(self.buffers, rows, strict=True):
            if mine is None:
                continue
            for buf, part in zip(bufs, _columns(mine, bufs), strict=True):
                buf.view(-1, buf.shape[-1]).index_copy_(0, slots[:mine.shape[0]], part)

    def read(self, slots: torch.Tensor, rows: Sequence[int] | None = None
             ) -> list[torch.Tensor]:
        """Per layer ``[S_i, its width]`` copies of the rows at ``slots[:S_i]`` (int64
        ``[S]``; ``S_i = rows[i]``, a layer's own rows, else ``S``)."""
        slots = slots.to(self.device)
        counts = rows if rows is not None else [slots.numel()] * len(self.buffers)
        return [torch.cat([buf.view(-1, buf.shape[-1]).index_select(0, slots[:n])
                           for buf in bufs], dim=1)
                for bufs, n in zip(self.buffers, counts, strict=True)]


def _columns(rows: torch.Tensor, bufs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """``rows [S, sum of widths]`` cut into each buffer's columns (contiguous copies)."""
    return [part.contiguous()
            for part in rows.split([b.shape[-1] for b in bufs], dim=1)]

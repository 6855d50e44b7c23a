"""How a data record's payload travels: cache views per run, and packs.

A data record carries, for its chunk's layers and tokens (:class:`~kv_transfer.chunk.KVChunk`),
every buffer of the layout (K, V[, index_k]; :mod:`~kv_transfer.payload`) of the layers that
have it (GLM-5.2's shared layers have no index_k:
:attr:`~kv_transfer.layout.BufferSpec.layers`).
The sender splits the buffers in two (the header's ``views`` and ``cuts``):

- view buffers (``header.views``): one message per (buffer, layer having it, cut), a view of
  the cache
  rows on both sides (no copy). ``header.cuts`` are the token offsets where the source or
  the destination slots break their consecutive run (:func:`~kv_transfer.chunk.runs`), so
  every cut is one run on both sides. Network pairs only, for buffers whose runs average
  :data:`MIN_RUN_BYTES` or more (a 128-token block of the 1 KiB/token MLA K buffer), and for
  every buffer when both slot lists are one run (a fresh allocation: one message per
  (buffer, layer)).
- packed buffers (the others): cut into packs of at most :data:`PACK_BYTES`; a pack is a group
  of layers and a token range ``(layers, a, b)``, its bytes are, buffer after buffer, the
  ``[Ly, b - a, *D]`` rows of each packed buffer (``Ly``: those of the layers that have it),
  gathered from the source slots into
  a staging buffer (or a shared-memory slot, :mod:`~kv_transfer.local`) and scattered into the
  destination slots. Both sides derive the same packs from the header alone.

View messages go first (buffer after buffer, layer major, cut minor), then the packs, one
message each, pipelined (:mod:`~kv_transfer.links`): at most :data:`PACK_DEPTH` packs per side
are in flight, so staging memory is bounded by ``PACK_DEPTH x PACK_BYTES`` per pair and side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kv_transfer import payload, wire
from kv_transfer.chunk import KVChunk, runs

PACK_BYTES = 4 << 20  # target bytes of one pack (one wire message / one shared-memory slot)
PACK_DEPTH = 4  # packs in flight per pair and side (staging memory: PACK_DEPTH x PACK_BYTES)
RUN_COPY_BYTES = 64 * 1024  # mean destination run (bytes) from which a scatter copies per run
MIN_RUN_BYTES = 64 * 1024  # mean run (bytes per layer) from which a buffer goes as views


def segment_bytes() -> int:
    """Size of a pair's same-node segment: ``PACK_DEPTH`` slots of ``PACK_BYTES``."""
    return PACK_DEPTH * PACK_BYTES


@dataclass(frozen=True)
class Pack:
    """One pack: ``layers`` (ids, a slice of the record's) x token offsets ``[a, b)`` within the
    record; ``nbytes`` its size."""

    layers: tuple[int, ...]
    a: int
    b: int
    nbytes: int


def plan_views(layout, header: wire.Header, network: bool) -> wire.Header:
    """``header`` with its ``views`` and ``cuts`` chosen (sender side): none off the network
    (a same-node pair packs everything); else every buffer when both slot lists are one run,
    or the buffers whose messages (one per layer and run) average :data:`MIN_RUN_BYTES`."""
    chunk = header.chunk
    if not network:
        return header
    found = runs(chunk.src_slots, chunk.dst_slots)
    sizes = token_bytes(layout, chunk)
    # NOTE: a buffer's messages and bytes scale alike with its layer count: per layer here
    views = tuple(b for b, nb in enumerate(sizes) if len(found) == 1
                  or chunk.n_tokens * nb >= MIN_RUN_BYTES * len(found))
    return replace(header, views=views, cuts=tuple(r.start for r in found) if views else ())


def cut_views(cache: object, layout, header: wire.Header, heads: slice | None,
              slots: torch.Tensor) -> list[torch.Tensor]:
    """The cache rows of every view message, in wire order: per view buffer, per layer having
    it (``layout``), per cut of ``header.cuts``, the rows of ``slots`` (this side's int64
    ``[T]``, CPU) in that cut (may be non-contiguous: a GQA head subset).

    Raises:
        ValueError: a cut is not one run of ``slots`` (the sender broke the protocol).
    """
    bounds = list(header.cuts) + [header.chunk.n_tokens]
    if any(r.start not in header.cuts for r in runs(slots)):
        raise ValueError(f"cuts {header.cuts} split no run of this side's slots")
    firsts = [int(slots[a]) for a in header.cuts]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    return [payload.flat(cache, buffer, layer, heads)[s:s + n]
            for buffer in header.views
            for layer in layout.buffers[buffer].in_layers(header.chunk.layers)
            for s, n in zip(firsts, lengths)]


def token_bytes(layout, chunk: KVChunk) -> list[int]:
    """Bytes per token per layer of each buffer (layout order) for ``chunk``'s heads."""
    return [math.prod(layout.token_dims(spec, chunk.head_range())) * layout.element_size
            for spec in layout.buffers]


def packs(layout, header: wire.Header, limit: int | None = None) -> list[Pack]:
    """The packs of data record ``header``, in wire order (layer groups, then token ranges).

    ``limit``: bytes per pack (default :data:`PACK_BYTES`). Whole layers are grouped while a
    group fits (a layer's bytes: its packed buffers, :meth:`KVLayout.layer_buffers`); a layer
    larger than ``limit`` is cut into token ranges.

    Raises:
        ValueError: one token of one layer is larger than ``limit``.
    """
    limit = PACK_BYTES if limit is None else limit
    n, out, group, group_bytes = header.chunk.n_tokens, [], [], 0
    for layer, per_token in zip(header.chunk.layers, _layer_token_bytes(layout, header)):
        if per_token > limit:
            raise ValueError(f"one token of one layer is {per_token} B, more than a pack "
                             f"({limit} B): raise kv_transfer.packs.PACK_BYTES")
        if per_token and (n * per_token > limit or group_bytes + n * per_token > limit) \
                and group:
            out.append(Pack(tuple(group), 0, n, group_bytes))
            group, group_bytes = [], 0
        if n * per_token > limit:
            step = limit // per_token
            out += [Pack((layer,), a, min(a + step, n), (min(a + step, n) - a) * per_token)
                    for a in range(0, n, step)]
        elif per_token:
            group.append(layer)
            group_bytes += n * per_token
    if group:
        out.append(Pack(tuple(group), 0, n, group_bytes))
    return out


def _layer_token_bytes(layout, header: wire.Header) -> list[int]:
    """Packed bytes of one token of each of the record's layers (its buffers not sent as
    views, for the record's heads)."""
    sizes = token_bytes(layout, header.chunk)
    return [sum(nb for b, (spec, nb) in enumerate(zip(layout.buffers, sizes))
                if b not in header.views and spec.in_layers((layer,)))
            for layer in header.chunk.layers]


def _views(buf: torch.Tensor, layout, header: wire.Header,
           pack: Pack) -> list[tuple[int, torch.Tensor, int, tuple[int, ...]]]:
    """``buf`` (uint8, at least ``pack.nbytes``) viewed as the pack's per-buffer tensors
    ``[Ly, b - a, *D]`` (``Ly``: the pack's layers that have the buffer): ``(buffer, tensor,
    bytes per token, those layers)`` per packed buffer a layer of the pack has."""
    out, at, heads = [], 0, header.chunk.head_range()
    for buffer, (spec, nb) in enumerate(zip(layout.buffers, token_bytes(layout, header.chunk))):
        layers = spec.in_layers(pack.layers)
        if buffer in header.views or not layers:
            continue
        size = len(layers) * (pack.b - pack.a) * nb
        shape = (len(layers), pack.b - pack.a, *layout.token_dims(spec, heads))
        out.append((buffer, payload.as_tensor(buf[at:at + size], shape, layout.torch_dtype), nb,
                    layers))
        at += size
    return out


def gather(cache: object, layout, header: wire.Header, heads: slice | None,
           src_slots: torch.Tensor, pack: Pack, out: torch.Tensor) -> None:
    """Copy the pack's rows from ``src_slots`` (int64 ``[T]``, cache device) into ``out``."""
    rows = src_slots[pack.a:pack.b]
    for buffer, view, _, layers in _views(out, layout, header, pack):
        payload.gather(cache, buffer, layers, heads, rows, out=view)


def scatter(cache: object, layout, header: wire.Header, heads: slice | None,
            dst_slots: torch.Tensor, pack: Pack, src: torch.Tensor) -> None:
    """Write the pack held in ``src`` into ``dst_slots`` (int64 ``[T]``, cache device).

    A buffer whose destination runs average :data:`RUN_COPY_BYTES` or more is written one
    ``copy_`` per run (about memcpy speed), else with one ``index_copy_`` per layer.
    """
    rows = dst_slots[pack.a:pack.b]
    firsts = rows.cpu()
    found = runs(firsts)
    for buffer, view, nb, layers in _views(src, layout, header, pack):
        if rows.numel() * nb < RUN_COPY_BYTES * len(found):
            payload.scatter(cache, buffer, layers, heads, rows, view)
            continue
        for i, layer in enumerate(layers):
            flat = payload.flat(cache, buffer, layer, heads)
            for r in found:
                slot = int(firsts[r.start])
                flat[slot:slot + len(r)].copy_(view[i, r.start:r.stop])

"""How a data record's payload travels: cache views per run, and packs.

A data record carries, for its layers and tokens ``[token_start, token_end)``, every buffer
of the layout (K, V[, index_k]; :mod:`~kv_transfer.payload`). The sender splits the buffers
in two (the header's ``views`` and ``cuts``):

- view buffers (``header.views``): one message per (buffer, layer, cut), a view of the cache
  rows on both sides (no copy). ``header.cuts`` are the token offsets where the source or
  the destination rows break their consecutive run, so every cut is one run on both sides.
  With ``header.block_views`` (both caches ``block_major``, :mod:`engine.kv_cache`) the
  messages are block runs instead: whole blocks of every layer of the record at once
  (:func:`block_pieces`, :func:`block_views`), at most about :data:`MAX_VIEW_BYTES` each.
  Network pairs only, for buffers whose runs average :data:`MIN_RUN_BYTES` or more (a
  128-token block of the 1 KiB/token MLA K buffer), and for every buffer when both slot
  lists are one run (a fresh allocation: one message per (buffer, layer)).
- packed buffers (the others): cut into packs of at most :data:`PACK_BYTES`; a pack is a group
  of layers and a token range ``(layers, a, b)``, its bytes are, buffer after buffer, the
  ``[len(layers), b - a, *D]`` rows of each packed buffer, gathered from the source slots into
  a staging buffer (or a shared-memory slot, :mod:`~kv_transfer.local`) and scattered into the
  destination slots. Both sides derive the same packs from the header alone.

View messages go first (buffer after buffer, layer major, cut minor), then the packs.

Packs go one message each, pipelined (:mod:`~kv_transfer.links`): the sender gathers pack
``i + 1`` while pack ``i`` is on the wire and the receiver scatters pack ``i`` while pack
``i + 1`` arrives; at most :data:`PACK_DEPTH` packs per side are in flight, so staging memory
is bounded by ``PACK_DEPTH x PACK_BYTES`` per pair and side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kv_transfer import payload, wire

PACK_BYTES = 4 << 20  # target bytes of one pack (one wire message / one shared-memory slot)
PACK_DEPTH = 4  # packs in flight per pair and side (staging memory: PACK_DEPTH x PACK_BYTES)
RUN_COPY_BYTES = 64 * 1024  # mean destination run (bytes) from which a scatter copies per run
MIN_RUN_BYTES = 64 * 1024  # mean run (bytes per layer) from which a buffer goes as views
MAX_VIEW_BYTES = 16 << 20  # a block-run view message holds whole blocks up to about this


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


def run_start(slots: torch.Tensor) -> int | None:
    """First slot when ``slots`` (int64 ``[T]``, T > 0) are one consecutive ascending run,
    else None."""
    s = slots.cpu()
    if s.numel() > 1 and not bool((s[1:] - s[:-1]).eq(1).all()):
        return None
    return int(s[0])


def cut_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Token ranges that are one consecutive run in both ``src`` and ``dst`` slots (int64
    ``[T]``, T > 0): ``(offset, first src slot, first dst slot, length)``."""
    s, d = src.cpu(), dst.cpu()
    breaks = (s[1:] - s[:-1]).ne(1) | (d[1:] - d[:-1]).ne(1)
    starts = [0] + (breaks.nonzero().flatten() + 1).tolist()
    ends = starts[1:] + [s.numel()]
    return [(a, int(s[a]), int(d[a]), b - a) for a, b in zip(starts, ends)]


def view_buffers(layout, header: wire.Header, messages: int, single: bool) -> tuple[int, ...]:
    """Buffers worth sending as views with ``messages`` messages each: every buffer when
    ``single`` (both slot lists one run, or one block-run message), else those whose
    messages average :data:`MIN_RUN_BYTES` or more (see module docstring)."""
    sizes = token_bytes(layout, header)
    if single:
        return tuple(range(len(sizes)))
    return tuple(b for b, nb in enumerate(sizes)
                 if header.n_tokens * len(header.layers) * nb >= MIN_RUN_BYTES * messages)


def cut_views(cache: object, layout, header: wire.Header, heads: slice | None,
              starts: list[int]) -> list[torch.Tensor]:
    """The cache rows of every view message, in wire order: per view buffer, per layer, per
    cut ``[starts[i], starts[i] + length_i)`` (may be non-contiguous: a GQA head subset)."""
    bounds = list(header.cuts) + [header.n_tokens]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    return [payload.flat(cache, buffer, layer, heads)[s:s + n]
            for buffer in header.views for layer in header.layers
            for s, n in zip(starts, lengths)]


def plan_block_views(cache: object, layout, peer, header: wire.Header,
                     src_slots: torch.Tensor) -> tuple[wire.Header, list[torch.Tensor]] | None:
    """The sender's block-view plan of MLA data record ``header``: the header with
    ``block_views``, ``cuts`` and ``views`` set, and the cache memory of its view messages
    (:func:`block_views`); None when block views do not apply (either cache not
    ``block_major``, block sizes or layer counts differ, the record's layers not one
    ascending range, or a cut starting at different offsets in a block on the two sides).

    Args:
        layout, peer: this side's and the decode side's ``KVLayout``.
        src_slots: int64 ``[T]`` (CPU) source slots of the record.
    """
    layers, bs = header.layers, layout.block_size
    if not (layout.cache_layout == peer.cache_layout == "block_major"
            and hasattr(cache, "backing")
            and (peer.block_size, peer.num_layers) == (bs, layout.num_layers)
            and layers == tuple(range(layers[0], layers[0] + len(layers)))):
        return None
    found = cut_runs(src_slots, header.dst_slots.cpu())
    if any(s % bs != d % bs for _, s, d, _ in found):
        return None
    header = replace(header, block_views=True, cuts=tuple(a for a, *_ in found))
    pieces = block_pieces(header, src_slots, bs, block_run_blocks(layout, header))
    n = block_messages(header, pieces, layout.num_layers, bs)
    header = replace(header, views=view_buffers(layout, header, n, n == 1))
    if not header.views:
        return replace(header, cuts=(), block_views=False), []
    return header, block_views(cache, header, pieces)


def block_pieces(header: wire.Header, slots: torch.Tensor, block_size: int,
                 max_blocks: int) -> list[tuple[int, int, int, bool]]:
    """The pieces of a ``block_views`` record, in wire order: each cut (``header.cuts``) split
    at block boundaries into ``(offset, first slot, length, whole)``, where ``whole`` marks a
    run of at most ``max_blocks`` whole blocks (first slot at a block start, length a
    multiple of ``block_size``) and the other pieces lie inside one block.

    ``slots``: int64 ``[T]`` (CPU) of either side: a cut starts at the same offset in a block
    on both sides (the sender checks it), so both sides find the same pieces.
    ``max_blocks``: :func:`block_run_blocks`.
    """
    bounds = list(header.cuts) + [header.n_tokens]
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        first, t = int(slots[a]), a
        while t < b:
            slot = first + t - a
            off = slot % block_size
            whole = min((b - t) // block_size, max_blocks) * block_size if off == 0 else 0
            n = whole or min(block_size - off, b - t)
            pieces.append((t, slot, n, bool(whole)))
            t += n
    return pieces


def block_run_blocks(layout, header: wire.Header) -> int:
    """Whole blocks per block-run message: as many as fit :data:`MAX_VIEW_BYTES` in the
    record's largest buffer, at least one. The same on both sides (layout and header only)."""
    block_bytes = max(token_bytes(layout, header)) * layout.block_size * layout.num_layers
    return max(1, MAX_VIEW_BYTES // block_bytes)


def block_messages(header: wire.Header, pieces: list[tuple[int, int, int, bool]],
                   num_layers: int, block_size: int) -> int:
    """Messages per view buffer of a ``block_views`` record (see :func:`block_views`)."""
    every = header.layers == tuple(range(num_layers))
    return sum((1 if every else n // block_size) if whole else len(header.layers)
               for _, _, n, whole in pieces)


def block_views(cache: object, header: wire.Header,
                pieces: list[tuple[int, int, int, bool]]) -> list[torch.Tensor]:
    """The cache memory of every view message of a ``block_views`` record, in wire order:
    per view buffer, per piece (:func:`block_pieces`): a run of ``k`` whole blocks is ONE
    message ``backing[b:b + k]`` (``[k, num_layers, block_size, *D]``) when the record
    carries every layer, else one per block ``backing[b, l0:l0 + Ly]`` (its layers must be
    one ascending range); a piece inside one block is one message per layer, its rows
    ``[n, *D]``. All contiguous (``cache.backing``, :class:`engine.kv_cache.KVCache`
    ``block_major``).
    """
    layers = header.layers
    l0, ly = layers[0], len(layers)
    bs = cache.spec.block_size
    every = layers == tuple(range(cache.spec.num_layers))
    out: list[torch.Tensor] = []
    for buffer in header.views:
        backing = cache.backing[buffer]
        for _, slot, n, whole in pieces:
            if whole and every:
                out.append(backing[slot // bs:(slot + n) // bs])
            elif whole:
                out.extend(backing[b, l0:l0 + ly] for b in range(slot // bs, (slot + n) // bs))
            else:
                row = int(payload.rows_of(cache, torch.tensor(slot)))
                out.extend(payload.flat(cache, buffer, layer, None)[row:row + n]
                           for layer in layers)
    return out


def token_bytes(layout, header: wire.Header) -> list[int]:
    """Bytes per token per layer of each buffer (layout order) for ``header``'s heads."""
    return [math.prod(layout.token_dims(spec, header.head_range())) * layout.element_size
            for spec in layout.buffers]


def packs(layout, header: wire.Header, limit: int | None = None) -> list[Pack]:
    """The packs of data record ``header``, in wire order (layer groups, then token ranges).

    ``limit``: bytes per pack (default :data:`PACK_BYTES`). Whole layers are grouped while a
    group fits; a layer larger than ``limit`` is cut into token ranges.

    Raises:
        ValueError: one token of one layer is larger than ``limit``.
    """
    limit = PACK_BYTES if limit is None else limit
    per_token = sum(nb for b, nb in enumerate(token_bytes(layout, header))
                    if b not in header.views)
    if per_token == 0:
        return []
    if per_token > limit:
        raise ValueError(f"one token of one layer is {per_token} B, more than a pack "
                         f"({limit} B): raise kv_transfer.packs.PACK_BYTES")
    n, layers = header.n_tokens, header.layers
    if n * per_token <= limit:
        step = limit // (n * per_token)
        return [Pack(layers[i:i + step], 0, n, len(layers[i:i + step]) * n * per_token)
                for i in range(0, len(layers), step)]
    step = limit // per_token
    return [Pack((layer,), a, min(a + step, n), (min(a + step, n) - a) * per_token)
            for layer in layers for a in range(0, n, step)]


def _views(buf: torch.Tensor, layout, header: wire.Header,
           pack: Pack) -> list[tuple[int, torch.Tensor, int]]:
    """``buf`` (uint8, at least ``pack.nbytes``) viewed as the pack's per-buffer tensors
    ``[len(layers), b - a, *D]``: ``(buffer, tensor, bytes per token)`` per packed buffer."""
    out, at = [], 0
    for buffer, (spec, nb) in enumerate(zip(layout.buffers, token_bytes(layout, header))):
        if buffer in header.views:
            continue
        size = len(pack.layers) * (pack.b - pack.a) * nb
        shape = (len(pack.layers), pack.b - pack.a, *layout.token_dims(spec, header.head_range()))
        out.append((buffer, payload.as_tensor(buf[at:at + size], shape, layout.torch_dtype), nb))
        at += size
    return out


def gather(cache: object, layout, header: wire.Header, heads: slice | None,
           src_slots: torch.Tensor, pack: Pack, out: torch.Tensor) -> None:
    """Copy the pack's rows from ``src_slots`` (int64 ``[T]``, cache device) into ``out``."""
    rows = src_slots[pack.a:pack.b]
    for buffer, view, _ in _views(out, layout, header, pack):
        payload.gather(cache, buffer, pack.layers, heads, rows, out=view)


def scatter(cache: object, layout, header: wire.Header, heads: slice | None,
            dst_slots: torch.Tensor, pack: Pack, src: torch.Tensor) -> None:
    """Write the pack held in ``src`` into ``dst_slots`` (int64 ``[T]``, cache device).

    A buffer whose destination runs average :data:`RUN_COPY_BYTES` or more is written one
    ``copy_`` per run (about memcpy speed), else with one ``index_copy_`` per layer.
    """
    rows = dst_slots[pack.a:pack.b]
    found = runs(rows)
    for buffer, view, nb in _views(src, layout, header, pack):
        if rows.numel() * nb < RUN_COPY_BYTES * len(found):
            payload.scatter(cache, buffer, pack.layers, heads, rows, view)
            continue
        for i, layer in enumerate(pack.layers):
            flat = payload.flat(cache, buffer, layer, heads)
            for offset, slot, n in found:
                flat[slot:slot + n].copy_(view[i, offset:offset + n])


def runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ascending ``slots`` (int64 ``[T]``, T > 0):
    ``(offset, first slot, length)``."""
    s = slots.cpu()
    starts = [0] + ((s[1:] - s[:-1]).ne(1).nonzero().flatten() + 1).tolist()
    ends = starts[1:] + [s.numel()]
    return [(a, int(s[a]), b - a) for a, b in zip(starts, ends)]

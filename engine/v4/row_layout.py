"""Where a DeepSeek-V4 request's shipped state sits in its staging rows, and when each row is
final: what lets prefill ship the state chunk by chunk (docs/kv_transfer.md "DeepSeek-V4").

A layer's rows are its kind's width (:func:`engine.v4.staging.kind_widths`: the sum of the
kind's tensor widths) and hold, for a request of ``n`` prompt tokens, two regions, each its
streams' rows flattened end to end and zero-padded to whole rows (:func:`kind_layout`):

1. entries, rows ``[0, entry_rows)``: the ``entry`` tensors side by side (``compressed_kv |
   index_keys``), entry after entry;
2. tail, rows ``[entry_rows, entry_rows + tail_rows)``: the ``token`` tensors (``window_kv``)
   of the last ``min(n, sliding_window - 1)`` tokens (the window decode keeps), then each
   ``request`` tensor (compressor / indexer open-group state) in spec order;

and nothing after: a layer ships its kind's own rows (:func:`layer_rows`; the decode tracker
expects per layer that many). :func:`staged_rows`, the most any kind needs, is the slots a
request's staging takes on each side (a narrower kind leaves its slots past its own rows
unused, never shipped).

Final after ``e`` of the ``n`` tokens (:func:`final_rows`): entry ``i`` once computed
(``i < e // compress_ratio``), never rewritten; window row of token ``t >= n - min(n, W - 1)``
once computed (``t < e``); the state only at ``e = n``. A row is final when every element in
it is, so each region's rows become final as a prefix, and :func:`chunk_rows` gives the rows a
chunk ``[start, end)`` makes final: each of a layer's own rows exactly once over a prompt's
chunks. Bound: each region wastes under one row, so a kind needs at most ``ceil(elements(n) /
width) + 1`` rows (tests: ``staged_rows(n) <= n``).

Everything is read off the kind's :class:`~engine.v4.kv_spec.V4LayerSpec` (tensors, ``per``,
rows after ``n`` tokens); the data comes through a reader ``read(name, first, last) ->
[last - first, width]`` (the exported dicts on decode, the paged cache on prefill:
:func:`engine.v4.state_io.cache_reader`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.v4.config import V4Config
from engine.v4.kv_spec import PER_ENTRY, PER_REQUEST, PER_TOKEN, V4LayerSpec, kv_specs

Reader = Callable[[str, int, int], torch.Tensor]
# NOTE: the name of this layout in the transfer layout's fingerprint (staging.layout_text):
# where the tensors sit in a layer's rows, and that a layer ships only its kind's own rows
# (a peer that ships or expects zero rows up to staged_rows is refused, not misread)
ROW_LAYOUT = "entries|window+state;own-rows"


@dataclass(frozen=True)
class Stream:
    """``rows`` rows of the tensors ``names`` side by side (spec order; ``widths`` theirs)."""

    names: tuple[str, ...]
    widths: tuple[int, ...]
    rows: int

    @property
    def elements(self) -> int:
        return self.rows * sum(self.widths)


@dataclass(frozen=True)
class KindLayout:
    """One kind's rows for a request of ``num_tokens`` prompt tokens (module docstring).

    Attributes:
        width: elements per row. window: window rows shipped (``min(n, W - 1)``).
        entries / tail: the regions' streams, in row order.
        entry_rows, tail_rows: whole rows each region takes (the tail's start at
            ``entry_rows``).
    """

    width: int
    window: int
    entries: tuple[Stream, ...]
    tail: tuple[Stream, ...]
    entry_rows: int
    tail_rows: int

    @property
    def rows(self) -> int:
        return self.entry_rows + self.tail_rows


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, end)`` of the layers ``layers`` (ascending)."""

    start: int
    end: int
    layers: tuple[int, ...]


def kind_layout(spec: V4LayerSpec, num_tokens: int) -> KindLayout:
    """The rows of ``spec``'s kind for a request of ``num_tokens`` (>= 1) prompt tokens."""
    tensors = spec.tensors()
    width = sum(t.width for t in tensors)

    def side_by_side(per: str, rows: int) -> tuple[Stream, ...]:
        mine = [t for t in tensors if t.per == per]
        return (Stream(tuple(t.name for t in mine), tuple(t.width for t in mine), rows),) \
            if mine and rows else ()

    window = min(num_tokens, spec.sliding_window - 1)
    entries = side_by_side(PER_ENTRY, num_tokens // spec.compress_ratio
                           if spec.compress_ratio else 0)
    tail = side_by_side(PER_TOKEN, window) + tuple(
        Stream((t.name,), (t.width,), spec.rows(t, num_tokens))
        for t in tensors if t.per == PER_REQUEST and spec.rows(t, num_tokens))
    return KindLayout(width, window, entries, tail,
                      _whole_rows(entries, width), _whole_rows(tail, width))


def _whole_rows(streams: tuple[Stream, ...], width: int) -> int:
    return -(-sum(s.elements for s in streams) // width)


def layer_rows(config: V4Config, num_tokens: int) -> tuple[int, ...]:
    """Per layer the rows it ships for a request of ``num_tokens`` (>= 1) prompt tokens: its
    kind's (:func:`kind_layout`), what the decode tracker expects of that layer."""
    rows = {kind: kind_layout(spec, num_tokens).rows for kind, spec in kv_specs(config).items()}
    return tuple(rows[kind] for kind in config.layer_types)


def staged_rows(config: V4Config, num_tokens: int) -> int:
    """Staging slots a request of ``num_tokens`` (>= 1) prompt tokens takes on each side: the
    most rows any layer ships (:func:`layer_rows`), at least 1; the done records' count."""
    return max((1, *layer_rows(config, num_tokens)))


def most_staged_rows(config: V4Config, max_tokens: int) -> tuple[int, int]:
    """The most :func:`staged_rows` of any prompt of ``1 <= n <= max_tokens`` tokens, and an
    ``n`` taking them: ``(rows, n)``. What a staging pool must hold for one request
    of any length up to ``max_tokens`` (a pool sized for ``max_tokens`` itself is not enough:
    ``staged_rows`` is not monotonic in ``n``, its state rows follow ``n % ratio``).

    Exact, in ``O(max(W, ratio))`` evaluations: from ``n >= max(W - 1, ratio)`` on, a kind's
    tail rows depend only on ``n % ratio`` (window full, overlap state present, open groups
    ``n % ratio`` tokens) and its entry rows never fall as ``n`` grows, so over those ``n``
    each residue is at its most at its largest ``n <= max_tokens``: the last ``ratio``
    values. The ``n`` below are evaluated one by one (tests: equal to the maximum over every
    ``n``).

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"most_staged_rows: max_tokens ({max_tokens}) must be >= 1")
    specs = kv_specs(config).values()
    ratio = max((1, *(s.compress_ratio for s in specs)))
    settled = max((ratio, *(s.sliding_window - 1 for s in specs)))
    candidates = sorted(set(range(1, min(max_tokens, settled) + 1))
                        | set(range(max(1, max_tokens - ratio + 1), max_tokens + 1)))
    rows, shortest = max((staged_rows(config, n), -n) for n in candidates)
    return rows, -shortest


def final_rows(spec: V4LayerSpec, num_tokens: int, computed: int
               ) -> tuple[tuple[int, int], ...]:
    """Row ranges of ``spec``'s kind that are final once ``computed`` of the ``num_tokens``
    prompt tokens are (``0 <= computed <= num_tokens``; none at 0)."""
    if computed <= 0:
        return ()
    lay = kind_layout(spec, num_tokens)
    if computed >= num_tokens:
        return ((0, lay.rows),)
    ratio, n = spec.compress_ratio, num_tokens
    per_entry = sum(t.width for t in spec.tensors() if t.per == PER_ENTRY)
    per_token = sum(t.width for t in spec.tensors() if t.per == PER_TOKEN)
    done = computed // ratio if ratio else 0  # NOTE: entries computed so far
    entry_rows = lay.entry_rows if done == (n // ratio if ratio else 0) else \
        done * per_entry // lay.width
    in_window = max(0, computed - (n - lay.window))  # NOTE: final-window tokens computed
    tail_rows = in_window * per_token // lay.width
    return ((0, entry_rows), (lay.entry_rows, lay.entry_rows + tail_rows))


def chunk_rows(config: V4Config, num_tokens: int, start: int, end: int
               ) -> tuple[RowRange, ...]:
    """The rows a prefill chunk of tokens ``[start, end)`` makes final, per layer group (layers
    of kinds with the same ranges share a range), ordered by ``start``: each of a layer's own
    rows ``[0, layer_rows(num_tokens)[layer])`` is in exactly one chunk of a prompt cut into
    consecutive chunks, and no row past them is in any; the state goes with the last chunk.

    Raises:
        ValueError: not ``0 <= start < end <= num_tokens``.
    """
    if not 0 <= start < end <= num_tokens:
        raise ValueError(f"chunk [{start}, {end}) of a {num_tokens}-token prompt")
    by_range: dict[tuple[int, int], list[int]] = {}
    for kind, spec in kv_specs(config).items():
        before = _cells(final_rows(spec, num_tokens, start))
        after = _cells(final_rows(spec, num_tokens, end))
        layers = [i for i, k in enumerate(config.layer_types) if k == kind]
        for span in _spans(sorted(after - before)):
            by_range.setdefault(span, []).extend(layers)
    return tuple(RowRange(a, b, tuple(sorted(layers)))
                 for (a, b), layers in sorted(by_range.items()))


def _cells(ranges: tuple[tuple[int, int], ...]) -> set[int]:
    return {r for a, b in ranges for r in range(a, b)}


def _spans(rows: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``rows`` as maximal ``[a, b)`` runs."""
    out: list[tuple[int, int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out


def pack_rows(layout: KindLayout, read: Reader, first: int, last: int,
              dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rows ``[first, last)`` of one layer, ``[last - first, layout.width]`` in ``dtype``:
    reads only the stream rows they overlap (zeros past each region's data)."""
    w = layout.width
    out = torch.zeros((last - first) * w, dtype=dtype, device=device)
    for streams, a, b in ((layout.entries, 0, layout.entry_rows),
                          (layout.tail, layout.entry_rows, layout.rows)):
        lo, hi = max(first, a), min(last, b)
        if lo < hi:
            at = (lo - first) * w
            _fill(out[at:at + (hi - lo) * w], streams, read, (lo - a) * w)
    return out.view(last - first, w)


def _fill(out: torch.Tensor, streams: tuple[Stream, ...], read: Reader, lo: int) -> None:
    """Write elements ``[lo, lo + out.numel())`` of the region ``streams`` (flattened end to
    end) into ``out`` (left as is past the data)."""
    hi, off = lo + out.numel(), 0
    for s in streams:
        a, b, width = max(lo, off), min(hi, off + s.elements), sum(s.widths)
        if a < b:
            r0, r1 = (a - off) // width, -(-(b - off) // width)
            rows = torch.cat([read(name, r0, r1) for name in s.names], dim=1).reshape(-1)
            skip = a - off - r0 * width
            out[a - lo:b - lo] = rows[skip:skip + b - a].to(out.dtype)
        off += s.elements


def unpack_rows(spec: V4LayerSpec, rows: torch.Tensor, num_tokens: int
                ) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_rows` over all of a layer's rows ``[>= kind rows, width]``:
    ``{name: [spec.rows(t, num_tokens), width]}`` (views into ``rows``)."""
    lay = kind_layout(spec, num_tokens)
    out: dict[str, torch.Tensor] = {}
    for streams, a, b in ((lay.entries, 0, lay.entry_rows), (lay.tail, lay.entry_rows, lay.rows)):
        flat, off = rows[a:b].reshape(-1), 0
        for s in streams:
            block = flat[off:off + s.elements].view(s.rows, sum(s.widths))
            out.update(zip(s.names, block.split(list(s.widths), dim=1), strict=True))
            off += s.elements
    for t in spec.tensors():  # NOTE: a tensor with no rows yet is shipped empty
        out.setdefault(t.name, rows.new_zeros(0, t.width))
    return out

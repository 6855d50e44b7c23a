"""Prefill side: one data record on a pair, posted and later waited for.

:func:`post_data` rings the record's doorbell (its header, :mod:`~kv_transfer.wire`), posts
the cache views of its view buffers (no copy; network pairs), then gathers its packs one by
one into the pair's pack transport (:mod:`~kv_transfer.links`), pack ``i + 1`` while pack
``i`` is on the wire; it returns the record :class:`InFlight`. :func:`wait_sent` waits,
bounded, until every message of it left: only then may its source rows change.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from kv_transfer import links, packs, payload, wire
from kv_transfer import pair as pairs
from kv_transfer.layout import KVLayout

Link = links.NetSender | links.LocalSender


@dataclass
class InFlight:
    """A data record posted to the backend, not yet known to have left.

    Attributes:
        header: the record as it went out (its ``chunk`` holds the source slots).
        pair: the pair generation it was posted on.
        works: the backend's handles of its view messages.
        views: the cache views those messages send (kept alive until they completed).
        link: the pack transport when it had packs, else None; ``upto`` its last pack.
        what: the record, for error messages.
        posted: ``time.perf_counter()`` at the doorbell; ``nbytes`` its payload bytes.
    """

    header: wire.Header
    pair: pairs.PairGroup
    works: list
    views: list[torch.Tensor]
    link: Link | None
    upto: int
    what: str
    posted: float
    nbytes: int


def post_data(cache: object, layout: KVLayout, rank: int, pair: pairs.PairGroup, link: Link,
              header: wire.Header, stats: payload.PayloadStats) -> InFlight:
    """Ring ``header``'s doorbell and post its payload: the view buffers' cache views, then
    the packs, each gathered while the ones before it are on the wire.

    ``rank``: this prefill rank (its local heads, GQA). Raises the pair's
    :class:`~kv_transfer.errors.TransferError`.
    """
    chunk = header.chunk
    heads = local_heads(layout, rank, chunk.head_range())
    header, views = _plan_views(cache, layout, header, heads, isinstance(link, links.NetSender))
    what = (f"data record of request {chunk.request_id} layers "
            f"{chunk.layers[0]}..{chunk.layers[-1]} tokens "
            f"[{chunk.token_start}, {chunk.token_end})")
    pair.post_doorbell(wire.encode_header(header), what)
    posted = time.perf_counter()
    works = pair.post(views, what)
    seq, gather_s = 0, 0.0
    frames = packs.packs(layout, header)
    for pack in frames:
        buf = link.take(pack.nbytes, what)
        t0 = time.perf_counter()
        packs.gather(cache, layout, header, heads, chunk.src_slots, pack, buf)
        gather_s += time.perf_counter() - t0
        seq = link.post(buf, pack.nbytes, what)
    if frames:
        stats.add(gather_s=gather_s)
    nbytes = sum(v.numel() * v.element_size() for v in views) + sum(p.nbytes for p in frames)
    return InFlight(header, pair, works, views, link if frames else None, seq, what, posted,
                    nbytes)


def wait_sent(sent: InFlight, timeout_s: float, stats: payload.PayloadStats) -> None:
    """Wait until every message of ``sent`` left (each wait bounded by ``timeout_s``).
    Raises the pair's :class:`~kv_transfer.errors.TransferError`."""
    sent.pair.wait_sent(sent.works, timeout_s, sent.what)
    if sent.link is not None:
        sent.link.wait(sent.upto, sent.what)
    stats.add(wire_s=time.perf_counter() - sent.posted, nbytes=sent.nbytes)


def _plan_views(cache: object, layout: KVLayout, header: wire.Header, heads: slice | None,
                network: bool) -> tuple[wire.Header, list[torch.Tensor]]:
    """The record's header (its ``views`` and ``cuts``, :func:`packs.plan_views`) and the
    cache views to send; none when a view would not be contiguous (a GQA head subset)."""
    header = packs.plan_views(layout, header, network)
    if not header.views:
        return header, []
    views = packs.cut_views(cache, layout, header, heads, header.chunk.src_slots.cpu())
    if not all(v.is_contiguous() for v in views):
        return replace(header, views=(), cuts=()), []
    return header, views


def local_heads(layout: KVLayout, rank: int, heads: range | None) -> slice | None:
    """Global pair heads -> slice of this rank's local head axis (None for MLA)."""
    if heads is None:
        return None
    mine = layout.heads_of(rank % layout.tp)  # NOTE: CP rank r * tp + t holds t's heads
    return slice(heads.start - mine.start, heads.stop - mine.start)

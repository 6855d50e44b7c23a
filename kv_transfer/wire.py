"""The one msgpack schema of the KV data plane.

Per pair, the prefill rank announces itself through the decode rank's TCPStore
(:class:`Announce`, answered by :class:`Ack`), then every record is::

    doorbell (store key "<pair prefix>/doorbell/<n>" = msgpack of Header)
    views (kind == "data"): one message [n, *dims] per (view buffer, layer, cut), views of
        the cache rows on both sides (the cuts are runs of consecutive rows on both sides);
        with ``block_views`` (both caches block_major) runs of whole blocks go as one message
        for every layer of the record ([k, layers, block_size, *dims] or [layers,
        block_size, *dims], :func:`kv_transfer.packs.block_views`)
    packs (kind == "data"): the other buffers, one pack per (layer group, token range)
        (:mod:`kv_transfer.packs`), each one message, or, on a same-node pair, a one-element
        "ready" message (the pack is in a shared-memory slot) answered by an "ack"

The buffers are the layout's (:attr:`KVLayout.buffers`, in that order); a V3 layout has K
and V, a V3.2 one adds index_k (the fingerprint tells them apart at the handshake). ``dims``
is the buffer's per-token dims, restricted to ``heads`` for GQA. Schema version 5 (4: no
block views; 3: one message per (buffer, layer, run of destination slots); 2: the header as a
group message).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import torch

from kv_transfer.errors import WireError

# NOTE: a peer of another schema is refused at the handshake (5: block views; 4: packed records, the
# announce's node and the ack's same-node segment; 3: doorbell key `<prefix>/doorbell/<n>`).
VERSION = 5
DATA, DONE, ABORT = "data", "done", "abort"
RECORD_KINDS = (DATA, DONE, ABORT)


@dataclass(frozen=True)
class Header:
    """One transfer record.

    Attributes:
        kind: ``data`` (the layout's payloads follow: K, V[, index_k]), ``done`` (this
            prefill rank sent every planned layer of tokens ``[0, num_tokens)``) or ``abort``
            (it will send no more).
        request_id: the request.
        prefill_rank: sending rank in its instance.
        fingerprint: sender's :meth:`KVLayout.fingerprint`.
        layers: layer ids of the payloads (data).
        heads: global KV head range ``(start, stop)`` (GQA data), None for MLA.
        token_start, token_end: token positions ``[start, end)`` of the payloads (data).
        dst_slots: int64 ``[token_end - token_start]`` decode slots, one per token (data).
        num_tokens: tokens of the request sent in all (done).
        error: why the sender aborted (abort).
        views: buffers (layout order numbers) sent as cache views per cut; the others go in
            packs (data; :mod:`kv_transfer.packs`).
        cuts: token offsets (from 0, ascending) where the view messages' runs start (data
            with views): runs of consecutive rows on both sides, or, with ``block_views``,
            of consecutive slots on both sides, starting at the same offset in a block.
        block_views: the view messages are block runs (:func:`kv_transfer.packs.block_views`):
            both caches ``block_major`` with one block size.
    """

    kind: str
    request_id: str
    prefill_rank: int
    fingerprint: str
    layers: tuple[int, ...] = ()
    heads: tuple[int, int] | None = None
    token_start: int = 0
    token_end: int = 0
    dst_slots: torch.Tensor | None = field(default=None, compare=False)
    num_tokens: int = 0
    error: str = ""
    views: tuple[int, ...] = ()
    cuts: tuple[int, ...] = ()
    block_views: bool = False

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start

    def head_range(self) -> range | None:
        return None if self.heads is None else range(*self.heads)


def encode_header(header: Header) -> bytes:
    """Serialize ``header`` (slots as raw little-endian int64 bytes)."""
    slots = b"" if header.dst_slots is None else \
        header.dst_slots.to(torch.int64).contiguous().numpy().tobytes()
    return msgpack.packb({
        "v": VERSION, "kind": header.kind, "rid": header.request_id,
        "prank": header.prefill_rank, "fp": header.fingerprint, "layers": list(header.layers),
        "heads": None if header.heads is None else list(header.heads),
        "t0": header.token_start, "t1": header.token_end, "slots": slots,
        "ntok": header.num_tokens, "err": header.error,
        "views": list(header.views), "cuts": list(header.cuts),
        "blocks": header.block_views}, use_bin_type=True)


def decode_header(raw: bytes) -> Header:
    """Parse and validate a header.

    Raises:
        WireError: not msgpack, wrong version, unknown kind, or inconsistent fields.
    """
    try:
        m = msgpack.unpackb(raw, raw=False)
        if m.get("v") != VERSION:
            raise WireError(f"header schema version {m.get('v')!r}, expected {VERSION}: "
                            "prefill and decode must run the same orch version")
        header = Header(kind=m["kind"], request_id=str(m["rid"]), prefill_rank=int(m["prank"]),
                        fingerprint=str(m["fp"]), layers=tuple(int(x) for x in m["layers"]),
                        heads=None if m["heads"] is None else (int(m["heads"][0]),
                                                               int(m["heads"][1])),
                        token_start=int(m["t0"]), token_end=int(m["t1"]),
                        dst_slots=_slots(m["slots"]) if m["kind"] == DATA else None,
                        num_tokens=int(m["ntok"]), error=str(m["err"]),
                        views=tuple(int(x) for x in m["views"]),
                        cuts=tuple(int(x) for x in m["cuts"]),
                        block_views=bool(m["blocks"]))
    except WireError:
        raise
    except Exception as exc:  # malformed msgpack / missing key / wrong type
        raise WireError(f"malformed KV transfer header ({type(exc).__name__}: {exc})") from exc
    _validate(header)
    return header


def _slots(raw: bytes) -> torch.Tensor:
    if len(raw) % 8:
        raise WireError(f"dst_slots has {len(raw)} bytes, not a multiple of 8 (int64)")
    return torch.frombuffer(bytearray(raw), dtype=torch.int64) if raw else \
        torch.empty(0, dtype=torch.int64)


def _validate(h: Header) -> None:
    if h.kind not in RECORD_KINDS:
        raise WireError(f"unknown record kind {h.kind!r}; expected one of {RECORD_KINDS}")
    if h.kind == DATA:
        if not h.layers or not 0 <= h.token_start < h.token_end:
            raise WireError(f"data record of {h.request_id!r} has layers {h.layers} and token "
                            f"range [{h.token_start}, {h.token_end}): both must be non-empty")
        if h.views and (not h.cuts or h.cuts[0] != 0 or list(h.cuts) != sorted(set(h.cuts))
                        or h.cuts[-1] >= h.n_tokens):
            raise WireError(f"data record of {h.request_id!r} has cuts {h.cuts}: expected "
                            f"ascending offsets from 0 below {h.n_tokens}")
        if h.dst_slots.numel() != h.n_tokens:
            raise WireError(f"data record of {h.request_id!r} has {h.dst_slots.numel()} slots "
                            f"for {h.n_tokens} tokens")


@dataclass(frozen=True)
class Announce:
    """Prefill -> decode, through the store: a new pair generation and the prefill layout;
    ``node``: the prefill rank's :func:`~kv_transfer.local.node_id` ("" when it does not want
    a same-node path)."""

    instance: str
    rank: int
    generation: int
    layout: dict
    node: str = ""


@dataclass(frozen=True)
class Ack:
    """Decode -> prefill, through the store: the decode layout (the pair is built either way;
    on a layout mismatch the prefill side sends only ``abort`` records carrying the error);
    ``local``: the handle of the pair's same-node segment (:mod:`kv_transfer.local`), b"" for
    none."""

    instance: str
    rank: int
    layout: dict
    local: bytes = b""


def pack(message: Announce | Ack) -> bytes:
    """Serialize a handshake message."""
    return msgpack.packb({"v": VERSION, **message.__dict__}, use_bin_type=True)


def unpack(raw: bytes, cls: type[Announce] | type[Ack]) -> Announce | Ack:
    """Parse a handshake message of type ``cls``. Raises WireError when malformed."""
    try:
        m = msgpack.unpackb(raw, raw=False)
        if m.pop("v") != VERSION:
            raise WireError("handshake schema version differs: run the same orch version")
        return cls(**m)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"malformed {cls.__name__} ({type(exc).__name__}: {exc})") from exc

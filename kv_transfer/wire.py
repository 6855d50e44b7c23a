"""The one msgpack schema of the KV data plane.

Per pair, the prefill rank announces itself through the decode rank's TCPStore
(:class:`Announce`, answered by :class:`Ack`), then every record is::

    doorbell (store key "<pair prefix>/doorbell/<n>" = msgpack of Header)
    views (kind == "data"): one message [n, *dims] per (view buffer, layer, cut), views of
        the cache rows on both sides (each cut is a run of consecutive slots on both sides)
    packs (kind == "data"): the other buffers, one pack per (layer group, token range)
        (:mod:`kv_transfer.packs`), each one message, or, on a same-node pair, a one-element
        "ready" message (the pack is in a shared-memory slot) answered by an "ack"

The buffers are the layout's (:attr:`KVLayout.buffers`, in that order); a V3 layout has K
and V, a V3.2 one adds index_k (the fingerprint tells them apart at the handshake). ``dims``
is the buffer's per-token dims, restricted to the chunk's heads for GQA. Every message
carries :data:`VERSION`; a peer of another one is refused at the handshake.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import torch

from kv_transfer.chunk import KVChunk
from kv_transfer.errors import WireError

VERSION = 7
DATA, DONE, ABORT = "data", "done", "abort"
RECORD_KINDS = (DATA, DONE, ABORT)


@dataclass(frozen=True)
class Header:
    """One transfer record.

    Attributes:
        kind: ``data`` (``chunk``'s payloads follow: K, V[, index_k]), ``done`` (this
            prefill rank sent every planned layer of tokens ``[0, num_tokens)``) or ``abort``
            (it will send no more).
        request_id: the request (``chunk.request_id`` for data).
        prefill_rank: sending rank in its instance.
        fingerprint: sender's :meth:`KVLayout.fingerprint`.
        chunk: what a data record carries (its ``src_slots`` never travel).
        num_tokens: tokens of the request sent in all (done).
        error: why the sender aborted (abort).
        views: buffers (layout order numbers) sent as cache views per cut; the others go in
            packs (data; :mod:`kv_transfer.packs`).
        cuts: token offsets (from 0, ascending) where the view messages' runs start (data
            with views): each a run of consecutive slots on both sides.
        forward_end: wall-clock seconds (``time.time()``) when the prefill forward that
            computed the last chunk ended (done; 0.0: not given). The decode side's
            ``kv_tail_s`` is measured from it.
        draft_hidden: done, MTP speculative decoding: ``[hidden]`` fp32 little-endian bytes
            of the main model's normed last hidden state at the last prompt position (what
            the decode side's first MTP draft starts from); b"" without MTP.
    """

    kind: str
    request_id: str
    prefill_rank: int
    fingerprint: str
    chunk: KVChunk | None = None
    num_tokens: int = 0
    error: str = ""
    views: tuple[int, ...] = ()
    cuts: tuple[int, ...] = ()
    forward_end: float = 0.0
    draft_hidden: bytes = b""


def data_header(chunk: KVChunk, prefill_rank: int, fingerprint: str) -> Header:
    """The header of a data record carrying ``chunk`` (no views yet: all packed)."""
    return Header(kind=DATA, request_id=chunk.request_id, prefill_rank=prefill_rank,
                  fingerprint=fingerprint, chunk=chunk)


def encode_header(header: Header) -> bytes:
    """Serialize ``header`` (slots as raw little-endian int64 bytes)."""
    c = header.chunk
    return msgpack.packb({
        "v": VERSION, "kind": header.kind, "rid": header.request_id,
        "prank": header.prefill_rank, "fp": header.fingerprint,
        "layers": [] if c is None else list(c.layers),
        "heads": None if c is None or c.heads is None else list(c.heads),
        "t0": 0 if c is None else c.token_start, "t1": 0 if c is None else c.token_end,
        "slots": b"" if c is None else c.dst_slots.to(torch.int64).contiguous().numpy().tobytes(),
        "ntok": header.num_tokens, "err": header.error,
        "views": list(header.views), "cuts": list(header.cuts),
        "fwd": header.forward_end, "dh": header.draft_hidden}, use_bin_type=True)


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
        chunk = None
        if m["kind"] == DATA:
            chunk = KVChunk(request_id=str(m["rid"]), layers=tuple(int(x) for x in m["layers"]),
                            token_start=int(m["t0"]), token_end=int(m["t1"]),
                            dst_slots=_slots(m["slots"]),
                            heads=None if m["heads"] is None else (int(m["heads"][0]),
                                                                   int(m["heads"][1])))
        header = Header(kind=m["kind"], request_id=str(m["rid"]), prefill_rank=int(m["prank"]),
                        fingerprint=str(m["fp"]), chunk=chunk, num_tokens=int(m["ntok"]),
                        error=str(m["err"]), views=tuple(int(x) for x in m["views"]),
                        cuts=tuple(int(x) for x in m["cuts"]),
                        forward_end=float(m.get("fwd", 0.0)),
                        draft_hidden=bytes(m.get("dh", b"")))
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
    if len(h.draft_hidden) % 4:
        raise WireError(f"done record of {h.request_id!r} has {len(h.draft_hidden)} bytes of "
                        "draft hidden state, not a multiple of 4 (fp32)")
    c = h.chunk
    if c is None:
        return
    if not c.layers or not 0 <= c.token_start < c.token_end:
        raise WireError(f"data record of {h.request_id!r} has layers {c.layers} and token "
                        f"range [{c.token_start}, {c.token_end}): both must be non-empty")
    if h.views and (not h.cuts or h.cuts[0] != 0 or list(h.cuts) != sorted(set(h.cuts))
                    or h.cuts[-1] >= c.n_tokens):
        raise WireError(f"data record of {h.request_id!r} has cuts {h.cuts}: expected "
                        f"ascending offsets from 0 below {c.n_tokens}")
    if c.dst_slots.numel() != c.n_tokens:
        raise WireError(f"data record of {h.request_id!r} has {c.dst_slots.numel()} slots "
                        f"for {c.n_tokens} tokens")


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

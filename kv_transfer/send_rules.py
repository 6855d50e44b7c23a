"""What a prefill sender decides, as pure functions (no threads, no I/O): the header that
goes on the wire for a queued record (or an ``abort`` in its place, or nothing), the text a
request failed on a pair reports, and how long a decode address that failed a connect is
left alone. ``SenderChannel`` (sender.py) is the pump around them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer import wire
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferError
from kv_transfer.peer import KVPeer


@dataclass(frozen=True)
class PeerDown:
    """The last failed connect of a channel: to ``peer``; records to it fail with ``error``
    until ``retry_at`` (monotonic seconds); ``backoff_s`` is the wait that led there."""

    peer: KVPeer
    error: str
    retry_at: float
    backoff_s: float


def mark_down(last: PeerDown | None, peer: KVPeer, error: str, config: TransferConfig,
              now: float) -> PeerDown:
    """``peer``'s address failed a connect at ``now``: back off ``retry_backoff_s``, doubling
    per failure in a row to the same address, up to ``connect_timeout_s``."""
    backoff = config.retry_backoff_s if last is None or last.peer != peer else \
        min(2 * last.backoff_s, config.connect_timeout_s)
    return PeerDown(peer, error, now + backoff, backoff)


def header_to_send(header: wire.Header, failure: str | None, mismatch: str | None,
                   pair_to_peer: bool, abort_sent: bool) -> wire.Header | None:
    """What goes on the wire for a queued record: its header, an ``abort`` header in its
    place, or None (nothing; the record is skipped).

    Args:
        header: the queued record.
        failure: the request's error if it already failed (here or on another pair).
        mismatch: the layout mismatch error of the pair to the record's decode rank, if any.
        pair_to_peer: a pair to the record's decode rank is up (the channel connects
            before asking, unless the request already failed or the record is an ``abort``:
            never for a lost cause).
        abort_sent: an ``abort`` of the request already went out on that pair generation.

    A live request on a compatible pair sends its record. A failed request, or any request
    on a pair whose layouts differ, sends one ``abort`` carrying the error per pair
    generation (an ``abort`` record stays as queued, with its own reason), and only on a
    pair that is up.
    """
    error = failure if failure is not None else mismatch
    if error is None and header.kind != wire.ABORT:
        return header
    if abort_sent or not pair_to_peer:
        return None
    if header.kind == wire.ABORT:
        return header
    return wire.Header(kind=wire.ABORT, request_id=header.request_id,
                       prefill_rank=header.prefill_rank, fingerprint=header.fingerprint,
                       error=error)


def failure_text(exc: Exception, pair_name: str | None) -> str:
    """What a request failed by ``exc`` on pair ``pair_name`` reports: the pair, once."""
    if isinstance(exc, TransferError) and exc.pair is not None:
        return str(exc)  # the message starts with its pair
    return f"{pair_name or 'KV pair'}: {exc}"

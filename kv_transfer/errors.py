"""Errors raised by the KV transfer layer.

Every message names the pair (prefill instance/rank -> decode instance/rank), the request and
what was missing, and says what to do. Callers tell errors apart by type (and ``pair``), never
by their text.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer failed (peer died, timed out, protocol violation).

    Attributes:
        pair: name of the pair the error happened on, e.g. ``"prefill p0/0 -> decode d0/0
            gen 3"`` (while connecting: ``"prefill p0/0 -> decode d0/0 at host:port"``); the
            message starts with it. None when no pair was involved.
    """

    def __init__(self, message: str, *, pair: str | None = None) -> None:
        super().__init__(message)
        self.pair = pair


class TransferTimeout(TransferError):
    """A bounded wait of the transfer layer ran out (connect, payload, completion)."""


class LayoutMismatchError(TransferError):
    """Prefill and decode KV layouts cannot exchange bytes (different dims, dtype, model...)."""


class WireError(TransferError):
    """A header on the wire does not follow the schema in :mod:`kv_transfer.wire`."""

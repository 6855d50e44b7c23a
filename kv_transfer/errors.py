"""Errors raised by the KV transfer layer.

Every message names the pair (prefill instance/rank -> decode instance/rank), the request and
what was missing, and says what to do.
"""

from __future__ import annotations


class TransferError(RuntimeError):
    """A KV transfer failed (peer died, timed out, protocol violation)."""


class TransferTimeout(TransferError):
    """A bounded wait of the transfer layer ran out (connect, header, payload, completion)."""


class LayoutMismatchError(TransferError):
    """Prefill and decode KV layouts cannot exchange bytes (different dims, dtype, model...)."""


class WireError(TransferError):
    """A header on the wire does not follow the schema in :mod:`kv_transfer.wire`."""

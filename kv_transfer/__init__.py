"""KV transfer layer: layout + fingerprint, transfer plan, pair communicators, sender/receiver.

Workers use :class:`PrefillKVConnector` and :class:`DecodeKVConnector`; see docs/kv_transfer.md.
Never imports Ray, gRPC or the orchestrator.

NOTE: importing the package imports no torch. :class:`KVPeer`, :class:`TransferConfig`,
:class:`KVPoll` / :class:`KVStatus` and the errors are plain Python (control-plane messages
and configs carry them, and the gRPC client must not pull torch); the other names load their
module on first access.
"""

from __future__ import annotations

from importlib import import_module

from kv_transfer.config import TransferConfig
from kv_transfer.errors import (LayoutMismatchError, TransferError, TransferTimeout,
                                WireError)
from kv_transfer.peer import KVPeer
from kv_transfer.status import KVPoll, KVStatus

_LAZY = {"DecodeKVConnector": "kv_transfer.decode_connector",
         "KVChunk": "kv_transfer.chunk",
         "KVLayout": "kv_transfer.layout",
         "PairPlan": "kv_transfer.plan",
         "PrefillKVConnector": "kv_transfer.prefill_connector",
         "TransferPlan": "kv_transfer.plan",
         "build_transfer_plan": "kv_transfer.plan"}

__all__ = ["KVPeer", "KVPoll", "KVStatus", "LayoutMismatchError", "TransferConfig",
           "TransferError", "TransferTimeout", "WireError", *sorted(_LAZY)]


def __getattr__(name: str) -> object:
    """The torch-using exports, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)

"""KV transfer layer: layout + fingerprint, transfer plan, pair communicators, sender/receiver.

Workers use :class:`PrefillKVConnector` and :class:`DecodeKVConnector`; see docs/kv_transfer.md.
Never imports Ray, gRPC or the orchestrator.
"""

from kv_transfer.config import TransferConfig
from kv_transfer.decode_connector import DecodeKVConnector
from kv_transfer.errors import (LayoutMismatchError, TransferError, TransferTimeout,
                                     WireError)
from kv_transfer.layout import KVLayout
from kv_transfer.plan import PairPlan, TransferPlan, build_transfer_plan
from kv_transfer.prefill_connector import PrefillKVConnector

__all__ = ["DecodeKVConnector", "KVLayout", "LayoutMismatchError", "PairPlan",
           "PrefillKVConnector", "TransferConfig", "TransferError", "TransferPlan",
           "TransferTimeout", "WireError", "build_transfer_plan"]

"""Where a decode request waits before it joins the running batch.

A decode request holds its blocks from ``reserve`` on. Until it joins the batch, the leader
keeps one :class:`ReservedRequest` for it (state :class:`DecodeRequestState`); once in the
batch it lives in the scheduler only. Each rank answers the leader's ``kv_status`` with its
connector's :class:`kv_transfer.KVStatus` per request.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.request import Request


class DecodeRequestState(enum.Enum):
    """Where a reserved request waits (vLLM v1 calls the second one WAITING_FOR_REMOTE_KVS)."""

    # blocks reserved and receivers armed; prefill's first token not admitted yet
    WAITING_FOR_FIRST_TOKEN = "waiting_for_first_token"
    # first token admitted; joins the batch once every rank has every layer of the prompt
    WAITING_FOR_KV = "waiting_for_kv"


@dataclass
class ReservedRequest:
    """A decode request that holds blocks and is not in the running batch yet.

    Attributes:
        request: the scheduler's request; ``blocks`` is the reservation, and
            ``output_token_ids`` is ``[first token]`` from ``admit`` on.
        state: what it waits for.
        deadline: ``time.monotonic()`` past which it fails (and its blocks are freed) if it
            has not joined the batch.
    """

    request: Request
    state: DecodeRequestState
    deadline: float

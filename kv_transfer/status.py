"""The state of one request's KV transfer, as both connectors report it (torch-free: the
decode ranks hand it to their leader through Ray).

``PrefillKVConnector.poll`` and ``DecodeKVConnector.poll`` answer one :class:`KVStatus` per
request, the idea of SGLang's disaggregation ``KVPoll``. What each state means on each side:

==============  ==========================================  ==================================
state           prefill rank (sender)                       decode rank (receiver)
==============  ==========================================  ==================================
WAITING         nothing of it queued or in flight, and      expected, no record of it arrived
                neither finished, failed nor aborted
                (unknown, or between two chunks)
TRANSFERRING    data or ``done`` records queued or in       records arrived, not all of them
                flight: its source slots are in use
SUCCESS         ``finish`` called and every record left     every planned (layer, token) cell
                                                            and ``done`` record arrived
FAILED          a record failed, and none is in flight      failed, aborted by the prefill
                any more (``error`` names the pair)         side, past its deadline, or not
                                                            expected (never, or released)
ABORTED         ``abort`` called, and none is in flight     (never: an abort from prefill is
                any more (``error`` is its reason)          FAILED here)
==============  ==========================================  ==================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class KVPoll(enum.Enum):
    """One request's transfer state on one rank (table in the module docstring)."""

    WAITING = "waiting"
    TRANSFERRING = "transferring"
    SUCCESS = "success"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class KVStatus:
    """What ``poll(request_id)`` answers.

    Attributes:
        state: see :class:`KVPoll`.
        error: why, for FAILED (names the pair and the cause) and ABORTED (the reason given
            to ``abort``); else None.
        tail_s: decode side, SUCCESS: seconds from the end of the prefill forward that
            computed the last chunk to the moment this rank held every cell (``kv_tail_s``);
            None when not measured.
        draft_hidden: decode side, SUCCESS: the ``done`` records' ``draft_hidden`` (MTP: fp32
            bytes of the last prompt position's hidden state; b"" when none came).

    NOTE: on the prefill side only TRANSFERRING means bytes may still be read from the
    request's source slots: every other state is idle, whatever the outcome.
    """

    state: KVPoll
    error: str | None = None
    tail_s: float | None = None
    draft_hidden: bytes = b""

    @property
    def busy(self) -> bool:
        """Records of the request are queued or in flight (prefill: its source slots are in
        use; decode: bytes arrive)."""
        return self.state is KVPoll.TRANSFERRING

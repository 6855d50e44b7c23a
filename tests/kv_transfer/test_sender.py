"""The sender's pure decisions: what a queued record becomes, and how a failure reads."""

import pytest
import torch

from kv_transfer import KVChunk, KVPeer, TransferConfig, wire
from kv_transfer.errors import TransferError, TransferTimeout
from kv_transfer.send_rules import failure_text, header_to_send, mark_down

DATA = wire.data_header(KVChunk("r", (0,), 0, 2, torch.tensor([3, 4])), 1, "f")
DONE = wire.Header(kind=wire.DONE, request_id="r", prefill_rank=1, fingerprint="f",
                   num_tokens=2)
ABORT = wire.Header(kind=wire.ABORT, request_id="r", prefill_rank=1, fingerprint="f",
                    error="client cancelled")


@pytest.mark.parametrize("header", [DATA, DONE, ABORT])
def test_live_request_on_a_compatible_pair_sends_its_record(header):
    assert header_to_send(header, None, None, pair_to_peer=True, abort_sent=False) is header


@pytest.mark.parametrize("header", [DATA, DONE])
def test_failed_request_sends_one_abort_with_its_error_only_on_a_pair_that_is_up(header):
    got = header_to_send(header, "pair lost", None, pair_to_peer=True, abort_sent=False)
    assert (got.kind, got.request_id, got.prefill_rank, got.error) == (wire.ABORT, "r", 1,
                                                                       "pair lost")
    assert got.chunk is None and got.fingerprint == "f"
    assert header_to_send(header, "pair lost", None, pair_to_peer=False,
                          abort_sent=False) is None  # never connect for a lost cause
    assert header_to_send(header, "pair lost", None, pair_to_peer=True,
                          abort_sent=True) is None  # the peer knows already


def test_layout_mismatch_turns_records_into_one_abort_carrying_the_mismatch():
    got = header_to_send(DATA, None, "dtype differs", pair_to_peer=True, abort_sent=False)
    assert (got.kind, got.error) == (wire.ABORT, "dtype differs")
    assert header_to_send(DONE, None, "dtype differs", pair_to_peer=True,
                          abort_sent=True) is None


def test_a_queued_abort_keeps_its_own_reason():
    assert header_to_send(ABORT, "pair lost", None, pair_to_peer=True,
                          abort_sent=False) is ABORT


def test_failure_text_names_the_pair_once_by_type_not_text():
    name = "prefill p0/0 -> decode d0/0 gen 2"
    named = TransferTimeout(f"{name}: data record: no progress within 1 s", pair=name)
    assert failure_text(named, name) == str(named)
    # an error raised off the pair is prefixed, even when its text looks like a pair name
    assert failure_text(ValueError("slot 9 -> decode slot 3"), name) == \
        f"{name}: slot 9 -> decode slot 3"
    assert failure_text(TransferError("closed"), None) == "KV pair: closed"


def test_an_abort_record_never_makes_a_pair():
    """An abort to a decode rank with no pair up is dropped: the rank got nothing of the
    request on a live pair (a torn-down pair failed it there), and a connect to a dead peer
    must not hold an abort."""
    assert header_to_send(ABORT, None, None, pair_to_peer=False, abort_sent=False) is None
    assert header_to_send(ABORT, None, None, pair_to_peer=True, abort_sent=True) is None


def test_a_dead_address_is_left_alone_for_a_doubling_backoff():
    cfg = TransferConfig(retry_backoff_s=1.0, connect_timeout_s=5.0)
    a, b = KVPeer("d0", 0, "h", 1), KVPeer("d0", 0, "h", 2)  # b: the rank, restarted
    down = mark_down(None, a, "refused", cfg, now=100.0)
    assert (down.retry_at, down.error) == (101.0, "refused")
    backoffs = []
    for _ in range(4):
        down = mark_down(down, a, "refused", cfg, now=200.0)
        backoffs.append(down.backoff_s)
    assert backoffs == [2.0, 4.0, 5.0, 5.0]  # doubling, up to connect_timeout_s
    assert mark_down(down, b, "refused", cfg, now=300.0).backoff_s == 1.0  # a new address

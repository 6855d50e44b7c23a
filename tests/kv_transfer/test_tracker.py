"""Decode-side request tracking: completion, deadlines, release, bad records (no network)."""

import threading
import time

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer import KVChunk, KVLayout, KVPoll, KVStatus, TransferConfig
from kv_transfer import wire
from kv_transfer.tracker import PairGeneration, RequestTracker

SOURCE = PairGeneration("prefill p0/0", 1)
SUCCESS = KVStatus(KVPoll.SUCCESS)


def _tracker(tp=1, layers=3, **cfg):
    spec = KVCacheSpec(layers, 8, 4, 16, 8)
    return RequestTracker(KVLayout.from_spec(spec, "m", tp), 0, TransferConfig(**cfg), "d0/0")


def _data(rid, prank, layers, t0, t1, slots=None):
    """``(prefill rank, chunk)`` of a data record."""
    slots = torch.arange(t0, t1) if slots is None else slots
    return prank, KVChunk(rid, layers, t0, t1, slots)


def _done(rid, prank, n):
    return wire.Header(kind=wire.DONE, request_id=rid, prefill_rank=prank, fingerprint="f",
                       num_tokens=n)


def _deliver(tr, record):
    """Admit and write ``record`` as the receiver does; True when its bytes were written."""
    req = tr.admit(SOURCE, *record, num_slots=32)
    if req is None or not tr.begin_write(req):
        return False
    tr.end_write(req, record[1], True)
    return True


def test_complete_only_after_every_layer_token_and_done_from_each_sender():
    tr = _tracker()
    tr.expect("r", 10, prefill_tp=2)  # P2 -> D1, 3 layers: rank 0 layers (0, 1), rank 1 (2,)
    assert tr.poll("r") == KVStatus(KVPoll.WAITING)  # nothing arrived yet
    assert _deliver(tr, _data("r", 0, (0, 1), 0, 6))
    assert _deliver(tr, _data("r", 1, (2,), 0, 10))
    tr.on_done(SOURCE, _done("r", 1, 10))
    assert tr.poll("r") == KVStatus(KVPoll.TRANSFERRING)
    assert _deliver(tr, _data("r", 0, (0, 1), 6, 10))
    assert tr.poll("r") == KVStatus(KVPoll.TRANSFERRING), "done record of rank 0 missing"
    tr.on_done(SOURCE, _done("r", 0, 10))
    assert tr.poll("r") == SUCCESS


def test_cp_prefill_completes_from_each_rank_s_token_pieces():
    tr = _tracker()
    tr.expect("r", 8, prefill_tp=1, prefill_cp=2)  # both ranks send all 3 layers
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 0, 2))  # rank 0: pieces 0 and 3
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 6, 8))
    assert _deliver(tr, _data("r", 1, (0, 1, 2), 2, 4))  # rank 1: pieces 1 and 2
    tr.on_done(SOURCE, _done("r", 0, 8))
    tr.on_done(SOURCE, _done("r", 1, 8))
    assert tr.poll("r").state is KVPoll.TRANSFERRING, "tokens [4, 6) still missing"
    assert _deliver(tr, _data("r", 1, (0, 1, 2), 4, 6))
    assert tr.poll("r") == SUCCESS


def test_deadline_fails_with_what_was_missing():
    tr = _tracker(completion_timeout_s=0.05)
    tr.expect("r", 4, prefill_tp=1)
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 0, 2))
    time.sleep(0.1)
    status = tr.poll("r")
    err = status.error
    assert status.state is KVPoll.FAILED and "completion_timeout_s" in err
    assert "prefill rank 0: 6 of 12" in err
    assert "done record missing" in err
    assert not _deliver(tr, _data("r", 0, (0, 1, 2), 2, 4)), "no writes after failure"


def test_release_stops_writes_and_forgets():
    tr = _tracker()
    tr.expect("r", 4, prefill_tp=1)
    record = _data("r", 0, (0, 1, 2), 0, 4)
    req = tr.admit(SOURCE, *record, 32)
    tr.release("r")
    assert not tr.begin_write(req), "write permission after release"
    status = tr.poll("r")
    assert status.state is KVPoll.FAILED and "not expected" in status.error, status
    assert tr.admit(SOURCE, *record, 32) is None  # unknown now: bytes are dropped
    tr.release("r")  # idempotent
    assert tr.pending() == 0


@pytest.mark.parametrize("record,match", [
    (_data("r", 0, (0, 5), 0, 2), "not all planned"),
    (_data("r", 0, (0,), 0, 9), "exceed the 4 expected"),
    (_data("r", 0, (0,), 0, 2, torch.tensor([3, 99])), "outside"),
    (_data("r", 3, (0,), 0, 2), "not planned to send"),
])
def test_bad_data_records_fail_the_request(record, match):
    tr = _tracker()
    tr.expect("r", 4, prefill_tp=1)
    assert tr.admit(SOURCE, *record, 32) is None
    status = tr.poll("r")
    assert status.state is KVPoll.FAILED and match in status.error, status


def test_abort_done_mismatch_and_pair_loss():
    tr = _tracker()
    for rid in ("a", "b", "c", "d"):
        tr.expect(rid, 4, prefill_tp=1)
    tr.on_abort(SOURCE, wire.Header(kind=wire.ABORT, request_id="a", prefill_rank=0,
                                  fingerprint="f", error="client cancelled"))
    assert "aborted the transfer: client cancelled" in tr.poll("a").error
    tr.on_done(SOURCE, _done("b", 0, 3))
    assert "finished 3 tokens, expected 4" in tr.poll("b").error
    assert _deliver(tr, _data("c", 0, (0,), 0, 2))
    tr.on_pair_lost(SOURCE, "pair lost: boom")
    assert tr.poll("c") == KVStatus(KVPoll.FAILED, "pair lost: boom")
    assert tr.poll("d") == KVStatus(KVPoll.WAITING), "the pair never carried it: not failed"
    with pytest.raises(ValueError, match="already expected"):
        tr.expect("d", 4, prefill_tp=1)


def test_release_waits_for_a_write_in_progress():
    """The receiver holds the write permission around a scatter or an in-place receive:
    ``release`` returns only after it, polling never blocks on it, and no write starts
    after."""
    tr = _tracker()
    tr.expect("r", 4, prefill_tp=1)
    record = _data("r", 0, (0, 1, 2), 0, 4)
    req = tr.admit(SOURCE, *record, 32)
    assert tr.begin_write(req)
    assert tr.poll("r").state is KVPoll.TRANSFERRING  # does not block on the running write
    log = []
    releaser = threading.Thread(target=lambda: (tr.release("r"), log.append("released")))
    releaser.start()
    releaser.join(0.2)
    assert releaser.is_alive(), "release returned while bytes were still being written"
    log.append("written")
    tr.end_write(req, record[1], True)
    releaser.join(5)
    assert log == ["written", "released"]
    assert not tr.begin_write(req), "a released request must not be written again"


def test_tokens_the_decode_cache_holds_are_not_expected():
    """Prefix cache: tokens before ``first_token`` are already there; the rest completes it."""
    tr = _tracker()
    tr.expect("r", 10, prefill_tp=1, first_token=8)
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 8, 10))
    tr.on_done(SOURCE, _done("r", 0, 10))
    assert tr.poll("r") == SUCCESS
    for bad in (-1, 10):
        with pytest.raises(ValueError, match="first_token"):
            tr.expect(f"x{bad}", 10, prefill_tp=1, first_token=bad)


def test_kv_tail_runs_from_the_prefill_forward_end_to_the_last_cell():
    """kv_tail_s (issue 27): the newest done record's forward end -> the moment the last
    (layer, token) cell arrived (a cell sent twice counts once); 0 when the cells came
    first; not measured without a forward end."""
    tr = _tracker(layers=2)
    tr.expect("r", 4, prefill_tp=1)
    assert _deliver(tr, _data("r", 0, (0,), 0, 4))
    assert _deliver(tr, _data("r", 0, (0,), 0, 4))  # a re-run chunk's layer: counted once
    t_forward = time.time()
    time.sleep(0.05)
    assert _deliver(tr, _data("r", 0, (1,), 0, 4))  # the last cell, 50 ms after the forward
    done = wire.Header(kind=wire.DONE, request_id="r", prefill_rank=0, fingerprint="f",
                       num_tokens=4, forward_end=t_forward)
    tr.on_done(SOURCE, wire.decode_header(wire.encode_header(done)))  # travels on the wire
    got = tr.poll("r")
    assert got.state is KVPoll.SUCCESS and 0.05 <= got.tail_s < 0.5, got
    tr.expect("early", 4, prefill_tp=1)
    assert _deliver(tr, _data("early", 0, (0, 1), 0, 4))
    tr.on_done(SOURCE, wire.Header(kind=wire.DONE, request_id="early", prefill_rank=0,
                                   fingerprint="f", num_tokens=4, forward_end=time.time() + 1))
    assert tr.poll("early").tail_s == 0.0  # every cell before the forward ended
    tr.expect("old", 4, prefill_tp=1)
    assert _deliver(tr, _data("old", 0, (0, 1), 0, 4))
    tr.on_done(SOURCE, _done("old", 0, 4))
    assert tr.poll("old") == SUCCESS  # no forward end given: not measured


def test_each_layer_expects_only_its_own_cells():
    """``layer_tokens`` (DeepSeek-V4's staging rows, each layer its kind's own count): the
    request completes without the cells past a layer's count, the missing count names only
    expected cells, and a record reaching past a layer's count fails the request naming it."""
    tr = _tracker()
    tr.expect("r", 6, prefill_tp=1, layer_tokens=(6, 2, 4))
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 0, 2))
    assert _deliver(tr, _data("r", 0, (0, 2), 2, 4))
    tr.on_done(SOURCE, _done("r", 0, 6))
    assert tr.poll("r").state is KVPoll.TRANSFERRING, "layer 0's tokens [4, 6) missing"
    assert _deliver(tr, _data("r", 0, (0,), 4, 6))
    assert tr.poll("r") == SUCCESS
    slow = _tracker(completion_timeout_s=0.2)
    slow.expect("late", 6, prefill_tp=1, layer_tokens=(6, 2, 4))
    assert _deliver(slow, _data("late", 0, (0, 1, 2), 0, 2))
    time.sleep(0.3)
    assert "prefill rank 0: 6 of 12 (layer, token) cells missing" in slow.poll("late").error
    tr.expect("pad", 6, prefill_tp=1, layer_tokens=(6, 2, 4))
    assert tr.admit(SOURCE, *_data("pad", 0, (0, 1), 2, 6), num_slots=32) is None
    status = tr.poll("pad")
    assert status.state is KVPoll.FAILED and "of layer 1 exceed its 2 expected" in status.error
    for bad in ((6, 2), (6, 7, 4), (6, -1, 4)):
        with pytest.raises(ValueError, match="layer_tokens"):
            tr.expect(f"bad{bad}", 6, prefill_tp=1, layer_tokens=bad)

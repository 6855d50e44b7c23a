"""Decode-side request tracking: completion, deadlines, release, bad records (no network)."""

import time

import pytest
import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer import KVLayout, TransferConfig
from kv_transfer import wire
from kv_transfer.tracker import PairGeneration, RequestTracker

SOURCE = PairGeneration("prefill p0/0", 1)


def _tracker(tp=1, layers=3, **cfg):
    spec = KVCacheSpec(layers, 8, 4, 16, 8)
    return RequestTracker(KVLayout.from_spec(spec, "m", tp), 0, TransferConfig(**cfg), "d0/0")


def _data(rid, prank, layers, t0, t1, slots=None):
    slots = torch.arange(t0, t1) if slots is None else slots
    return wire.Header(kind=wire.DATA, request_id=rid, prefill_rank=prank, fingerprint="f",
                       layers=layers, token_start=t0, token_end=t1, dst_slots=slots)


def _done(rid, prank, n):
    return wire.Header(kind=wire.DONE, request_id=rid, prefill_rank=prank, fingerprint="f",
                       num_tokens=n)


def _deliver(tr, header):
    req = tr.admit(SOURCE, header, num_slots=32)
    calls = []
    return req is not None and tr.write(req, header, lambda: calls.append(1)) and calls == [1]


def test_complete_only_after_every_layer_token_and_done_from_each_sender():
    tr = _tracker()
    tr.expect("r", 10, prefill_tp=2)  # P2 -> D1, 3 layers: rank 0 layers (0, 1), rank 1 (2,)
    assert _deliver(tr, _data("r", 0, (0, 1), 0, 6))
    assert _deliver(tr, _data("r", 1, (2,), 0, 10))
    tr.on_done(SOURCE, _done("r", 1, 10))
    assert not tr.is_complete("r")
    assert _deliver(tr, _data("r", 0, (0, 1), 6, 10))
    assert not tr.is_complete("r"), "done record of rank 0 still missing"
    tr.on_done(SOURCE, _done("r", 0, 10))
    assert tr.is_complete("r") and tr.failure("r") is None


def test_cp_prefill_completes_from_each_rank_s_token_pieces():
    tr = _tracker()
    tr.expect("r", 8, prefill_tp=1, prefill_cp=2)  # both ranks send all 3 layers
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 0, 2))  # rank 0: pieces 0 and 3
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 6, 8))
    assert _deliver(tr, _data("r", 1, (0, 1, 2), 2, 4))  # rank 1: pieces 1 and 2
    tr.on_done(SOURCE, _done("r", 0, 8))
    tr.on_done(SOURCE, _done("r", 1, 8))
    assert not tr.is_complete("r"), "tokens [4, 6) still missing"
    assert _deliver(tr, _data("r", 1, (0, 1, 2), 4, 6))
    assert tr.is_complete("r") and tr.failure("r") is None


def test_deadline_fails_with_what_was_missing():
    tr = _tracker(completion_timeout_s=0.05)
    tr.expect("r", 4, prefill_tp=1)
    assert _deliver(tr, _data("r", 0, (0, 1, 2), 0, 2))
    time.sleep(0.1)
    err = tr.failure("r")
    assert "completion_timeout_s" in err and "prefill rank 0: 6 of 12" in err
    assert "done record missing" in err
    assert not _deliver(tr, _data("r", 0, (0, 1, 2), 2, 4)), "no writes after failure"


def test_release_stops_writes_and_forgets():
    tr = _tracker()
    tr.expect("r", 4, prefill_tp=1)
    header = _data("r", 0, (0, 1, 2), 0, 4)
    req = tr.admit(SOURCE, header, 32)
    tr.release("r")
    assert tr.write(req, header, lambda: pytest.fail("wrote after release")) is False
    with pytest.raises(KeyError, match="call expect"):
        tr.is_complete("r")
    assert tr.admit(SOURCE, header, 32) is None  # unknown now: bytes are dropped
    tr.release("r")  # idempotent
    assert tr.pending() == 0


@pytest.mark.parametrize("header,match", [
    (_data("r", 0, (0, 5), 0, 2), "not all planned"),
    (_data("r", 0, (0,), 0, 9), "exceed the 4 expected"),
    (_data("r", 0, (0,), 0, 2, torch.tensor([3, 99])), "outside"),
    (_data("r", 3, (0,), 0, 2), "not planned to send"),
])
def test_bad_data_records_fail_the_request(header, match):
    tr = _tracker()
    tr.expect("r", 4, prefill_tp=1)
    assert tr.admit(SOURCE, header, 32) is None
    assert match in tr.failure("r")


def test_abort_done_mismatch_and_pair_loss():
    tr = _tracker()
    for rid in ("a", "b", "c", "d"):
        tr.expect(rid, 4, prefill_tp=1)
    tr.on_abort(SOURCE, wire.Header(kind=wire.ABORT, request_id="a", prefill_rank=0,
                                  fingerprint="f", error="client cancelled"))
    assert "aborted the transfer: client cancelled" in tr.failure("a")
    tr.on_done(SOURCE, _done("b", 0, 3))
    assert "finished 3 tokens, expected 4" in tr.failure("b")
    assert _deliver(tr, _data("c", 0, (0,), 0, 2))
    tr.on_pair_lost(SOURCE, "pair lost: boom")
    assert tr.failure("c") == "pair lost: boom"
    assert tr.failure("d") is None, "requests the pair never carried are not failed"
    with pytest.raises(ValueError, match="already expected"):
        tr.expect("d", 4, prefill_tp=1)


def test_release_waits_for_a_running_scatter():
    import threading
    tr = _tracker()
    tr.expect("r", 4, prefill_tp=1)
    header = _data("r", 0, (0, 1, 2), 0, 4)
    req = tr.admit(SOURCE, header, 32)
    started, finish, log = threading.Event(), threading.Event(), []

    def slow_scatter():
        started.set()
        finish.wait(5)
        log.append("scatter done")
    writer = threading.Thread(target=tr.write, args=(req, header, slow_scatter))
    writer.start()
    assert started.wait(5)
    assert tr.is_complete("r") is False  # polling does not block on the running copy
    releaser = threading.Thread(target=lambda: (tr.release("r"), log.append("released")))
    releaser.start()
    releaser.join(0.2)
    assert releaser.is_alive(), "release returned while a scatter was still writing"
    finish.set()
    writer.join(5)
    releaser.join(5)
    assert log == ["scatter done", "released"]

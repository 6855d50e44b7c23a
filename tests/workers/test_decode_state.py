"""Decode rank's reserved-request states (TP=1, no Ray): a reservation whose first token never
comes is freed at its deadline even when its KV arrived in full, a rank asked about KV it
no longer expects answers FAILED instead of raising, and ``admit`` never waits for a step in
progress."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decode_worker.role import ORPHAN_FACTOR, DecodeRole
from decode_worker.request_state import DecodeRequestState
from engine.sampling_params import SamplingParams
from kv_transfer import KVPoll
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.messages import Abort, Admit, Prefill, Reservation, Reserve
from engine.request import RequestSpec
from tests.workers.test_pd_ranks import start, wait_all_free, wait_events


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)


def test_reservation_never_admitted_is_freed_after_its_kv_arrived(ckpt):
    timeout_s = 0.5
    prefill = start(PrefillRole, ckpt, "prefill", completion_timeout_s=timeout_s)
    decode = start(DecodeRole, ckpt, "decode", completion_timeout_s=timeout_s)
    try:
        spec = RequestSpec("orphan", tuple(range(9)), SamplingParams(max_tokens=3))
        reservation = decode.request(Reserve(spec, 1))
        assert isinstance(reservation, Reservation), reservation
        assert decode.role.reserved["orphan"].state is DecodeRequestState.WAITING_FOR_FIRST_TOKEN
        prefill.request(Prefill(spec, reservation))
        wait_events(prefill, "orphan", lambda e: True)  # first token out; never admitted
        deadline = time.monotonic() + 10
        while decode.role.kv_status(["orphan"])["orphan"].state is not KVPoll.SUCCESS:
            assert time.monotonic() < deadline, decode.role.kv_status(["orphan"])
            time.sleep(0.02)
        (ev,) = wait_events(decode, "orphan", lambda e: e.finish_reason is not None, 10)
        assert ev.finish_reason == "error", ev
        assert f"within {ORPHAN_FACTOR * timeout_s} s of the reservation" in ev.error
        wait_all_free(prefill, decode)
        assert decode.leader.pool.num_live_sets == 0
        assert decode.status().kv_failures == 0  # its KV transfer did not fail
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_kv_status_of_a_request_not_expected_is_failed(ckpt):
    decode = start(DecodeRole, ckpt, "decode")
    try:
        status = decode.role.kv_status(["gone"])["gone"]
        assert status.state is KVPoll.FAILED and "not expected" in status.error
    finally:
        decode.shutdown()


def test_admit_returns_while_a_step_holds_the_lock(ckpt):
    """The router hands the first token over with ``admit``; it must not wait for the decode
    step in progress (a whole batch step under load, more when the loop takes the lock
    again first): the loop applies it before its next step."""
    decode = start(DecodeRole, ckpt, "decode")
    try:
        spec = RequestSpec("held", tuple(range(9)), SamplingParams(max_tokens=3))
        assert isinstance(decode.request(Reserve(spec, 1)), Reservation)
        returned = threading.Event()
        caller = threading.Thread(target=lambda: (decode.request(Admit("held", 7)), returned.set()))
        with decode.leader.lock:  # stands for a step in progress
            caller.start()
            assert returned.wait(5), "admit waited for the step's lock"
        caller.join(5)
        deadline = time.monotonic() + 5
        while decode.role.reserved["held"].state is not DecodeRequestState.WAITING_FOR_KV:
            assert time.monotonic() < deadline, decode.role.reserved["held"]
            time.sleep(0.01)
        assert decode.role.reserved["held"].request.output_token_ids == [7]
        assert decode.request(Abort("held"))
        assert decode.leader.pool.num_live_sets == 0
    finally:
        decode.shutdown()

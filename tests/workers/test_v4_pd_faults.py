"""DeepSeek-V4 PD faults, P1 -> D1 in one process (test_v4_pd.py's ranks): an abort after some
chunks' rows reached decode, or once the last chunk's rows are queued, frees each scheduler
block set exactly once and both sides' V4 pools; a rebuild on decode that raises ends the
request with a retryable error, everything free; an abort that lands during the rebuild
frees the rebuilt cache once."""

from __future__ import annotations

import threading

import pytest

from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from rank.messages import Abort, Prefill, Reserve
from tests.workers.test_pd_ranks import wait_all_free
from tests.workers.test_v4_pd import (FreeCounts, _hold_before, _prompt,  # noqa: F401 (fixtures)
                                      _run_until_decode_ends, _v4_free, _wait, pd, v4_ckpt)


@pytest.mark.parametrize("when", ["mid_prefill", "staged"])
def test_v4_abort_mid_transfer_frees_everything(pd, when):
    """Abort after two of four prefill chunks ran and their rows reached decode, or once the
    last chunk's rows are queued (records queued or in flight): both sides' scheduler block
    sets are freed exactly once and their V4 pools end free."""
    prefill, decode = pd
    held, resume = threading.Event(), threading.Event()
    queue = prefill.role.sends.queue
    spec = RequestSpec("ab-" + when, _prompt(30, 7),
                       SamplingParams(max_tokens=40, ignore_eos=True))

    def queue_then_hold(transfers, output=None):  # every rank, after the forward
        queue(transfers, output)
        if transfers and any(t.last for t in transfers) and not held.is_set():
            held.set()
            resume.wait(10)

    undo = lambda: None  # noqa: E731
    if when == "staged":
        prefill.role.sends.queue = queue_then_hold
    else:
        held, resume, undo = _hold_before(prefill, spec.request_id, 16)
    counts = FreeCounts(prefill, decode)
    sent = decode.role.connector.stats.snapshot()["transfers"]
    try:
        res = decode.request(Reserve(spec, 1))
        prefill.request(Prefill(spec, res))
        assert held.wait(30)
        if when == "mid_prefill":
            assert prefill.leader.scheduler.find(spec.request_id).num_computed_tokens == 16
            _wait(lambda: decode.role.connector.stats.snapshot()["transfers"] > sent)
        abort = threading.Thread(target=lambda: prefill.request(Abort(spec.request_id)))
        abort.start()
        resume.set()
        abort.join(30)
        assert not abort.is_alive()
    finally:
        resume.set()
        undo()
        prefill.role.sends.queue = queue
    assert decode.request(Abort(spec.request_id))
    wait_all_free(prefill, decode)
    counts.undo()
    counts.assert_each_once()
    for rank in (prefill, decode):
        _v4_free(rank)


def test_v4_rebuild_that_fails_fails_the_request_and_frees_it(pd):
    """Decode cannot rebuild the shipped state (here: the runner raises): the request ends
    with a retryable error naming it, every block free on both sides."""
    prefill, decode = pd
    admit = decode.runner.admit_staged

    def broken(*args, **kwargs):
        raise ValueError("staged rows are not the specs'")

    decode.runner.admit_staged = broken
    try:
        spec = RequestSpec("bad", _prompt(13, 3), SamplingParams(max_tokens=5, ignore_eos=True))
        (end,) = _run_until_decode_ends(prefill, decode, spec)
    finally:
        decode.runner.admit_staged = admit
    assert end.finish_reason == "error" and end.retryable, end
    assert "could not be rebuilt" in end.error and "not the specs'" in end.error
    wait_all_free(prefill, decode)
    for rank in (prefill, decode):
        _v4_free(rank)


def test_v4_abort_during_the_rebuild_frees_the_rebuilt_cache_once(pd):
    """An abort that lands while decode rebuilds the cache (here: right before the runner's
    import) frees the scheduler blocks at once and the rebuilt V4 blocks once."""
    prefill, decode = pd
    admit, rebuilt = decode.runner.admit_staged, threading.Event()

    def abort_then_admit(request_id, *args):
        assert decode.role.abort(request_id)
        admit(request_id, *args)
        rebuilt.set()

    decode.runner.admit_staged = abort_then_admit
    try:
        spec = RequestSpec("race", _prompt(21, 4), SamplingParams(max_tokens=5, ignore_eos=True))
        (end,) = _run_until_decode_ends(prefill, decode, spec)
    finally:
        decode.runner.admit_staged = admit
    assert end.finish_reason == "abort", end
    assert rebuilt.wait(10)  # NOTE: the abort's event comes before the rebuild ends
    wait_all_free(prefill, decode)
    for rank in (prefill, decode):
        _v4_free(rank)

"""A prefill rank whose reservations name a dead decode rank (issue 9, fault 5: decode-0
killed under load): the requests bound for it end on the prefill side at once (their KV
sends fail without a connect each, their blocks are freed, an abort returns at once), and a
request to a live decode rank is served meanwhile. Before: every record to the dead rank
retried the store connect for ``connect_timeout_s``, and ``abort`` waited for it under the
leader lock. With the prefix cache, requests sharing cached blocks with a failed one end with
every reference count back at zero."""

from __future__ import annotations

import socket
import time

from engine.sampling_params import SamplingParams
from kv_transfer import KVPeer
from rank.messages import Abort, Prefill, Reservation
from engine.request import RequestSpec
from tests.workers.test_pd_ranks import ckpt, pd, run_pd, wait_all_free  # noqa: F401

CONNECT_TIMEOUT_S = 10  # what test_pd_ranks.start configures: one connect's bound
SHARED = tuple(range(300, 324))  # a prefix the requests to the dead rank share


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_tokens(rank, rids: set[str], timeout_s: float = 30.0) -> dict:
    """Wait (bounded) until each of ``rids`` had its first event; those events by id."""
    first, deadline = {}, time.monotonic() + timeout_s
    while set(rids) - set(first):
        assert time.monotonic() < deadline, \
            f"no first event of {set(rids) - set(first)} within {timeout_s} s"
        for ev in rank.poll(0.1):
            first.setdefault(ev.request_id, ev)
    return first


def test_dead_decode_rank_costs_prefill_only_the_requests_bound_for_it(pd):
    prefill, decode = pd
    dead = (KVPeer("decode-9", 0, "127.0.0.1", _closed_port()),)
    t0 = time.monotonic()

    def bound_for_dead(i: int) -> None:
        # 30 tokens = 4 chunks each; the first 24 are shared (6 prefix-cache blocks of 4)
        spec = RequestSpec(f"dead{i}", SHARED + tuple(range(100 + i, 106 + i)),
                           SamplingParams(max_tokens=4))
        res = Reservation(spec.request_id, "decode-9", tuple(range(4)), 8, dead)
        prefill.request(Prefill(spec, res))

    for i in range(3):
        bound_for_dead(i)
    started = time.monotonic()
    assert prefill.request(Abort("dead2")) is True
    assert time.monotonic() - started < 2.0
    _first_tokens(prefill, {"dead0", "dead1"})  # prefill ends them; decode-9 gets no KV
    bound_for_dead(3)  # reads the cached blocks dead0/dead1 left; its sends fail too
    assert _first_tokens(prefill, {"dead3"})["dead3"].num_cached_tokens == len(SHARED)
    live = RequestSpec("live", (5, 6, 7, 8, 9), SamplingParams(max_tokens=4, ignore_eos=True))
    tokens, reason = run_pd(prefill, decode, live)
    assert reason == "length" and len(tokens) == 4
    wait_all_free(prefill, decode, timeout_s=5.0)
    assert time.monotonic() - t0 < CONNECT_TIMEOUT_S
    assert not any(r.ok for r in prefill.status().transfers if "decode-9" in r.pair)

"""A decode reservation that is never admitted is freed: aborted between reserve and prefill,
or left behind by a router that went away (prefill never delivers, nobody admits or aborts):
freed after 4 x completion_timeout_s (docs/workers.md, Protocol). One decode rank in this
process (TP=1, no Ray)."""

from __future__ import annotations

import time

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.messages import Abort, Reservation, Reserve, TokenEvent
from rank.rank import Rank
from engine.request import RequestSpec
from tests.leaks import assert_instances_idle, rank_busy
from tests.workers.test_pd_ranks import start

COMPLETION_TIMEOUT_S = 0.5
ORPHAN_TIMEOUT_S = 4 * COMPLETION_TIMEOUT_S  # docs/workers.md: 4 x completion_timeout_s


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    torch.set_num_threads(1)
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5)
    rank = start(DecodeRole, ckpt, "decode", block_size=8, blocks=32,
                 completion_timeout_s=COMPLETION_TIMEOUT_S)
    yield rank
    rank.shutdown()


def reserve(decode: Rank, request_id: str) -> Reservation:
    spec = RequestSpec(request_id, tuple(range(40, 60)), SamplingParams(max_tokens=12))
    res = decode.request(Reserve(spec, 1))
    assert isinstance(res, Reservation), res
    assert decode.status().free_blocks == decode.status().total_blocks - len(res.block_ids)
    return res


def final_event(decode: Rank, request_id: str, timeout_s: float) -> TokenEvent:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in decode.poll(0.1):
            if ev.request_id == request_id and ev.finish_reason is not None:
                return ev
    raise AssertionError(f"{request_id}: no final event within {timeout_s} s")


def assert_all_free(decode: Rank) -> None:
    assert_instances_idle([decode.status()])
    assert rank_busy(decode) is None, rank_busy(decode)


def test_reservation_aborted_before_prefill_is_freed(decode):
    reserve(decode, "cut")
    assert decode.request(Abort("cut")) is True
    assert final_event(decode, "cut", timeout_s=5).finish_reason == "abort"
    assert_all_free(decode)


def test_reservation_never_admitted_is_freed_after_the_orphan_timeout(decode):
    start = time.monotonic()
    reserve(decode, "orphan")  # then nothing: no prefill KV, no admit, no abort
    ev = final_event(decode, "orphan", timeout_s=ORPHAN_TIMEOUT_S + 10)
    assert ev.finish_reason == "error" and ev.source == "decode", ev
    assert time.monotonic() - start >= ORPHAN_TIMEOUT_S
    assert_all_free(decode)


def test_a_full_decode_refuses_a_reservation_until_blocks_are_freed(decode):
    """Blocks for prompt + max_tokens are held from reserve to the end: with every block
    reserved, a third request of the same size is refused (retryable: the router queues it),
    and reserved once one of the first two ends."""
    from rank.messages import Rejection

    def spec(rid: str) -> RequestSpec:  # 20 + 108 tokens = 16 blocks of 8: half the pool
        return RequestSpec(rid, tuple(range(40, 60)), SamplingParams(max_tokens=108))

    first = decode.request(Reserve(spec("full-a"), 1))
    second = decode.request(Reserve(spec("full-b"), 1))
    assert isinstance(first, Reservation) and isinstance(second, Reservation)
    assert decode.status().free_blocks == 0
    third = decode.request(Reserve(spec("full-c"), 1))
    assert isinstance(third, Rejection) and third.retryable, third
    assert "0 of 32 blocks free, 16 needed" in third.reason
    assert decode.request(Abort("full-a")) is True
    third = decode.request(Reserve(spec("full-c"), 1))
    assert isinstance(third, Reservation), third
    assert not set(third.block_ids) & set(second.block_ids)
    for rid in ("full-b", "full-c"):
        assert decode.request(Abort(rid)) is True
    assert_all_free(decode)

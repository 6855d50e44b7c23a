"""KV sent layer by layer while the prefill forward runs (issue 27), on prefill and decode
rank actors in one process (tp1 -> tp1, no Ray). A test hook makes each layer slow (it sleeps
after the layer's KV write), so the order of events is plain: layer ``l``'s bytes reach decode
before layer ``l + 1`` writes its KV; with ``transfer.layerwise`` off nothing leaves before the
forward ends. Outputs equal a solo greedy run either way; an abort or a dead decode rank in
mid-forward stops the request's sends at the next layer and leaks no block."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.runner import ModelRunner
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from prefill_worker.role import PrefillRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Abort, Admit, Prefill, Reservation, Reserve
from rank.rank import Rank
from tests.engine.engine_drive import generate_greedy
from tests.leaks import wait_ranks_idle
from tests.workers.test_pd_ranks import ckpt, run_pd, wait_events  # noqa: F401

DELAY_S = 0.25  # each layer's extra time after its KV write


def start(ckpt, role_cls, role: str, name: str, layerwise: bool = True,
          connect_timeout_s: float = 10) -> Rank:
    scheduler = SchedulerConfig(block_size=4, num_kv_blocks=64, chunk_size=8,
                                max_num_batched_tokens=16, max_num_seqs=4)
    transfer = TransferConfig(connect_timeout_s=connect_timeout_s, header_timeout_s=10,
                              payload_timeout_s=10, completion_timeout_s=20,
                              same_node="off", layerwise=layerwise)
    cfg = InstanceConfig(name=name, role=role, checkpoint_dir=str(ckpt), scheduler=scheduler,
                         transfer=transfer)
    rank = Rank(cfg, 0, role_cls)
    rank.start_alone()
    return rank


def slow_layers(prefill: Rank, on_write=None) -> list[tuple[int, float]]:
    """Make every layer of ``prefill``'s forward ``DELAY_S`` slower, after its KV write (and
    after the role's hook queued its sends); returns the (layer, monotonic time) of each
    write as it happens. ``on_write(layer)`` runs right after each. With layer by layer off
    the writes are timed through a hook of this test alone."""
    writes: list[tuple[int, float]] = []
    role_hook = prefill.role.layer_hook

    def layer_hook(step_inputs):
        sends = role_hook(step_inputs)

        def hook(layer: int) -> None:
            if sends is not None:
                sends(layer)
            writes.append((layer, time.monotonic()))
            if on_write is not None:
                on_write(layer)
            time.sleep(DELAY_S)
        return hook if step_inputs else sends

    prefill.role.layer_hook = layer_hook
    return writes


class Arrivals:
    """Watches a decode rank's received KV bytes: when each total was first reached."""

    def __init__(self, decode: Rank) -> None:
        self.stats, self.seen = decode.role.connector.stats, [(time.monotonic(), 0)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            nbytes = self.stats.snapshot()["bytes"]
            if nbytes != self.seen[-1][1]:
                self.seen.append((time.monotonic(), nbytes))
            time.sleep(0.002)

    def first_at(self, nbytes: int) -> float:
        """When at least ``nbytes`` had arrived (inf: never)."""
        return next((t for t, n in self.seen if n >= nbytes), float("inf"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.stats.snapshot()["bytes"]


@pytest.fixture
def solo(ckpt):
    torch.set_num_threads(1)
    return ModelRunner(ckpt, num_kv_blocks=16, block_size=16)


def spec(rid: str, n: int = 8, max_tokens: int = 4) -> RequestSpec:
    return RequestSpec(rid, tuple(range(300 + len(rid), 300 + len(rid) + n)),
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("layerwise", [True, False])
def test_layer_l_reaches_decode_before_layer_l_plus_1_writes(ckpt, solo, layerwise):
    prefill = start(ckpt, PrefillRole, "prefill", "prefill-0", layerwise)
    decode = start(ckpt, DecodeRole, "decode", "decode-0", layerwise)
    try:
        layers = prefill.runner.kv_spec.num_layers
        layer_bytes = 8 * prefill.runner.kv_spec.bytes_per_token_per_layer  # one chunk
        writes = slow_layers(prefill)
        arrivals = Arrivals(decode)
        s = spec("slow")
        expected, _ = generate_greedy(solo, list(s.prompt_token_ids), 4, tuple(range(4)))
        assert run_pd(prefill, decode, s) == (expected, "length")
        assert arrivals.stop() == layers * layer_bytes
        assert [layer for layer, _ in writes] == list(range(layers))
        arrived = [arrivals.first_at((i + 1) * layer_bytes) for i in range(layers)]
        if layerwise:  # layer l on decode while layer l + 1 still computes
            for i in range(layers - 1):
                assert arrived[i] < writes[i + 1][1], (i, arrived, writes)
            assert decode.role.kv_tail.count == 1 and decode.role.kv_tail.last_s < DELAY_S
        else:  # nothing before the whole forward ended
            assert arrived[0] > writes[-1][1] + DELAY_S * 0.9, (arrived, writes)
            assert decode.role.kv_tail.count == 1
        wait_ranks_idle(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_abort_in_mid_forward_stops_at_the_next_layer_and_frees_everything(ckpt):
    prefill = start(ckpt, PrefillRole, "prefill", "prefill-0")
    decode = start(ckpt, DecodeRole, "decode", "decode-0")
    aborted: list[bool] = []
    started = threading.Event()

    def abort_after_layer_0(layer: int) -> None:
        if layer == 0 and not started.is_set():  # NOTE: runs while layer 1 computes
            started.set()
            t = threading.Thread(target=lambda: aborted.append(
                prefill.request(Abort("gone"))), daemon=True)
            t.start()
            time.sleep(DELAY_S / 2)

    try:
        layer_bytes = 8 * prefill.runner.kv_spec.bytes_per_token_per_layer
        slow_layers(prefill, abort_after_layer_0)
        s = spec("gone", n=16)  # two chunks: the second one never sends either
        res = decode.request(Reserve(s, 1))
        assert isinstance(res, Reservation)
        prefill.request(Prefill(s, res))
        deadline = time.monotonic() + 20
        while not aborted:
            assert time.monotonic() < deadline, "prefill's abort did not return"
            time.sleep(0.01)
        # NOTE: True, or False when the loop drained the request (its prefill done, sends
        # idle) before the abort took the lock: it found nothing left to stop
        assert aborted in ([True], [False])
        assert prefill.role.kv_bytes_sent() <= layer_bytes  # layers 1.. never left
        assert decode.request(Abort("gone")) is True  # the router's order: prefill first
        wait_ranks_idle(prefill, decode)
        assert decode.role.connector.stats.snapshot()["bytes"] <= layer_bytes
        assert prefill.leader.pool.num_live_sets == 0 and decode.leader.pool.num_live_sets == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_decode_rank_dead_in_mid_forward_fails_only_its_pair(ckpt, solo):
    """Two requests in one prefill step, to two decode instances; one decode rank dies after
    layer 0 was written: its request's later layers go nowhere, the other request is served
    whole, and no block leaks on the prefill side or the live decode side."""
    # NOTE: the dead pair fails when the prefill's connect to it gives up: the whole
    # connect_timeout_s (10 s cost 10 s of CI); 5 s is still ample for the live pair
    prefill = start(ckpt, PrefillRole, "prefill", "prefill-0", connect_timeout_s=5)
    live = start(ckpt, DecodeRole, "decode", "decode-0")
    dead = start(ckpt, DecodeRole, "decode", "decode-1")

    def kill_after_layer_0(layer: int) -> None:
        if layer == 0:
            dead.role.connector.close()  # its receiver threads and rendezvous store go

    try:
        a, b = spec("to-live"), spec("to-dead")
        expected, _ = generate_greedy(solo, list(a.prompt_token_ids), 4, tuple(range(4)))
        res_a, res_b = live.request(Reserve(a, 1)), dead.request(Reserve(b, 1))
        assert isinstance(res_a, Reservation) and isinstance(res_b, Reservation)
        slow_layers(prefill, kill_after_layer_0)
        prefill.request(Prefill(b, res_b))
        prefill.request(Prefill(a, res_a))  # NOTE: both in the first step (16 tokens)
        firsts = {}
        deadline = time.monotonic() + 30
        while len(firsts) < 2:
            assert time.monotonic() < deadline, firsts
            for ev in prefill.poll(0.1):
                firsts.setdefault(ev.request_id, ev)
        assert firsts["to-live"].error is None
        live.request(Admit("to-live", firsts["to-live"].token_ids[0]))
        events = wait_events(live, "to-live", lambda e: e.finish_reason is not None)
        tokens = list(firsts["to-live"].token_ids) + [t for e in events for t in e.token_ids]
        assert (tokens, events[-1].finish_reason) == (expected, "length")
        wait_ranks_idle(prefill, live)
        records = {r.pair: r.ok for r in prefill.status().transfers}
        assert records == {"prefill-0:0->decode-0:0": True, "prefill-0:0->decode-1:0": False}
        assert prefill.leader.pool.num_live_sets == 0 and live.leader.pool.num_live_sets == 0
    finally:
        prefill.shutdown()
        live.shutdown()
        dead.shutdown()

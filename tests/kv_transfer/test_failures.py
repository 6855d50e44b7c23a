"""Failure semantics: layout mismatch, killed peers (clear error in time, no stuck threads,
pair remade afterwards)."""

import os
import queue
import signal
import time

import pytest

from kv_transfer import KVPeer

from .cluster import CTX, RID, Scenario, run_ranks
from .cluster import entry
from . import failure_ranks as fr

# NOTE: the bounds under test are short; the others leave room for a loaded 2-core box.
FAST = {"connect_timeout_s": 10.0, "header_timeout_s": 10.0, "payload_timeout_s": 10.0,
        "completion_timeout_s": 6.0}


def test_layout_mismatch_is_a_clear_error_on_both_sides():
    s = Scenario(prefill_tp=1, decode_tp=1, decode_dtype="bfloat16")
    addr_qs = [CTX.Queue()]
    out = run_ranks([(fr.decode_mismatch, ("decode", 0, s, addr_qs)),
                     (fr.prefill_mismatch, ("prefill", 0, s, addr_qs))], timeout_s=60)
    for key in (("decode", 0), ("prefill", 0)):
        assert key in out, f"{key} sent no report within 60 s (reports from {sorted(out)})"
        err, message = out[key]
        assert err is None, f"{key}: {err}"
        assert "dtype: prefill float32 vs decode bfloat16" in message, message
    assert "aborted the transfer" in out[("decode", 0)][1], out[("decode", 0)][1]


class _Procs:
    """Start rank processes one by one; collect reports; kill leftovers."""

    def __init__(self):
        self.results, self.procs = CTX.Queue(), {}

    def start(self, name, fn, *args):
        p = CTX.Process(target=entry, args=(fn, (name, 0, *args), self.results), daemon=True)
        p.start()
        self.procs[name] = p

    def collect(self, names, timeout_s):
        out, deadline = {}, time.monotonic() + timeout_s
        while set(names) - set(out) and time.monotonic() < deadline:
            try:
                role, _, err, info = self.results.get(timeout=0.5)
                out[role] = (err, info)
            except queue.Empty:
                pass
        return out

    def close(self):
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)


# NOTE: the completion bound is far off: a dead or hung prefill is told by its heartbeats
LIVENESS = {**FAST, "completion_timeout_s": 60.0, "heartbeat_s": 0.2, "peer_timeout_s": 2.0}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["kill", "stop"])
def test_killed_prefill_fails_request_then_pair_is_remade(sig):
    s = Scenario(prefill_tp=1, decode_tp=1, timeouts=LIVENESS)
    addr_q, mine = CTX.Queue(), CTX.Queue()
    chunk0, killed, restarted, expected = (CTX.Event() for _ in range(4))
    procs = _Procs()
    try:
        procs.start("decode", fr.decode_survives_prefill_kill, s, [addr_q, mine], chunk0, killed,
                    restarted, expected)
        procs.start("prefill", fr.prefill_then_hang, s, addr_q)
        assert chunk0.wait(60), "chunk 0 never arrived"
        os.kill(procs.procs["prefill"].pid, sig)
        _, (host, port) = mine.get(timeout=5)
        assert killed.wait(30), "decode never reported the failure"
        procs.start("prefill2", fr.prefill_restarted, s, [KVPeer("d0", 0, host, port)], restarted,
                    expected)
        out = procs.collect(["decode", "prefill2"], 60)
    finally:
        procs.close()
    assert out["prefill2"][0] is None, out["prefill2"][0]
    err, info = out["decode"]
    assert err is None, err
    assert "no heartbeat" in info["error"] and "prefill p0/0" in info["error"], info
    assert info["failed_after"] < LIVENESS["peer_timeout_s"] + 3.0, info
    # the replaced generation's receiver thread is gone; only the new pair's remains
    assert len([t for t in info["threads_before_close"] if t.startswith("kv-recv")]) == 1, info


def test_killed_decode_fails_request_then_pair_is_remade():
    s = Scenario(prefill_tp=1, decode_tp=1, timeouts=FAST)
    addr_q, chunk0, killed = CTX.Queue(), CTX.Event(), CTX.Event()
    procs = _Procs()
    try:
        procs.start("prefill", fr.prefill_survives_decode_kill, s, addr_q, chunk0, killed)
        procs.start("decode", fr.decode_then_hang, s, addr_q, chunk0)
        assert chunk0.wait(60), "chunk 0 never arrived"
        procs.procs["decode"].terminate()
        procs.procs["decode"].join(10)
        killed.set()
        procs.start("decode2", fr.decode_restarted, s, addr_q)
        out = procs.collect(["prefill", "decode2"], 60)
    finally:
        procs.close()
    assert out["decode2"][0] is None, out["decode2"][0]
    err, info = out["prefill"]
    assert err is None, err
    assert "-> decode d0/0" in info["error"] and f"request {RID}" in info["error"], info
    assert "the peer died or closed the pair" in info["error"], info
    assert info["failed_after"] < FAST["payload_timeout_s"], info
    assert [t for t in info["threads_before_close"] if t.startswith("kv-send")] == \
        ["kv-send-p0/0->d0/0"], info

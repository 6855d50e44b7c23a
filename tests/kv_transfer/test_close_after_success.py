"""A prefill rank that closes its connector and exits as soon as its request is SUCCESS on its
side: the decode rank still gets the request. On a same-node pair the prefill side is done once
its ready messages left, while the decode rank acks each pack only after scattering it; a pair
closed before those acks arrived failed the decode side's record ("Connection closed by peer",
seen as a flaky tests/workers/test_v4_pd_tp.py P2-D1 under load). Here the decode rank's
scatter is slowed so the prefill process is surely gone before the acks unless its close waits
for them (``LocalSender.drain``)."""

from __future__ import annotations

import time

from engine.kv_cache import KVCache
from kv_transfer import (DecodeKVConnector, KVLayout, KVPeer, KVPoll, KVStatus,
                         PrefillKVConnector, TransferConfig, packs)

from .cluster import (RID, Scenario, check_received, decode_spec, prefill_spec,
                      reference_prefill_cache, run_ranks, slots, wait_settled)

S = Scenario(prefill_tp=1, decode_tp=1, chunks=((0, 37),))
TIMEOUTS = {"connect_timeout_s": 30.0, "header_timeout_s": 30.0, "payload_timeout_s": 30.0,
            "completion_timeout_s": 60.0}
SCATTER_DELAY_S = 1.0


def prefill_and_exit(role: str, rank: int, address: tuple) -> dict:
    """Send RID, wait for SUCCESS on this side, close; the process exits right after."""
    layout = KVLayout.from_spec(prefill_spec(S), "tiny-mla", 1)
    conn = PrefillKVConnector(reference_prefill_cache(S), layout, "p0", rank, 1,
                              TransferConfig(**TIMEOUTS))
    peers = [KVPeer("d0", 0, *address)]
    conn.send_chunk(RID, peers, 0, S.num_tokens, slots(S, "prefill", 0, S.num_tokens),
                    slots(S, "decode", 0, S.num_tokens))
    conn.finish(RID, peers, S.num_tokens)
    status = conn.wait(RID, 30)
    assert status == KVStatus(KVPoll.SUCCESS), status
    conn.close()
    return conn.stats.snapshot()


def test_decode_gets_a_request_whose_prefill_closed_right_after_success(monkeypatch):
    scatter = packs.scatter

    def slow_scatter(*args, **kwargs):
        time.sleep(SCATTER_DELAY_S)  # NOTE: the prefill process ends meanwhile, unless it waits
        return scatter(*args, **kwargs)
    monkeypatch.setattr(packs, "scatter", slow_scatter)
    spec = decode_spec(S)
    cache = KVCache(spec)
    conn = DecodeKVConnector(cache, KVLayout.from_spec(spec, "tiny-mla", 1), "d0", 0,
                             TransferConfig(**TIMEOUTS))
    try:
        conn.expect(RID, S.num_tokens, 1)
        out = run_ranks([(prefill_and_exit, ("prefill", 0, conn.address))], timeout_s=90)
        err, _ = out[("prefill", 0)]
        assert err is None, err
        status = wait_settled(conn, RID, 30)
        assert status == KVStatus(KVPoll.SUCCESS), status
        check_received(S, cache)
        conn.release(RID)
    finally:
        conn.close()

"""DeepSeek-V4 PD across TP sizes, P2 -> D1 and P1 -> D2, in forked rank processes (gloo TP
groups, the real KV connectors, no Ray): each prefill rank runs the prompt in chunks of 8 and,
after each chunk, stages the rows of the request's (whole, replicated) V4 state that chunk made
final and sends those of the layers the transfer plan gives it; every decode rank receives
every layer, rebuilds the request's paged cache and decodes.
Each prefill rank stages only the layers it sends (a rank's missing layer would reach decode
as zeros). The greedy tokens equal a colocated tp-1 runner's (which equal transformers',
tests/engine/test_v4_runner.py) for prompts shorter than the window, longer, and across compression groups;
each decode rank expects per layer its own row count (``layer_rows``) and receives each such
(layer, row) exactly once, nothing past them; bytes sent and received are the plan's, per layer
its own rows x width (P2 -> D1: one copy of the rows split over two senders; P1 -> D2: a copy
per decode rank); every V4 group block is free on both sides afterwards.

This drives the runner and connectors as the roles do (prefill_worker/kv_sends.py
``staged_transfers``, decode_worker/v4_staged.py); the roles themselves, SPMD over TP ranks, are
V3's (tests/workers/test_pd_ranks.py at tp 1, tests/e2e/test_glm5_up.py across tp)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.block_pool import BlockPool, slot_mapping
from engine.runner import SeqStep
from kv_transfer import DecodeKVConnector, KVPeer, KVPoll, KVStatus, PrefillKVConnector
from kv_transfer.config import TransferConfig
from rank.kv_setup import staged_layout
from tests.kv_transfer.cluster import run_ranks, wait_settled
from tests.ports import free_port
from tests.rank_processes import CTX
from tests.workers.test_v4_pd import _prompt, _solo_greedy

PROMPTS = {"short": 5, "long": 23, "groups": 33}
NEW = 12
P_BLOCK, D_BLOCK, BLOCKS, CHUNK = 4, 8, 64, 8
CFG = TransferConfig(connect_timeout_s=30, header_timeout_s=30, payload_timeout_s=30,
                     completion_timeout_s=60)


@pytest.fixture(scope="module")
def v4_ckpt(tmp_path_factory):
    from orchestrator.cli import main  # noqa: PLC0415

    out = tmp_path_factory.mktemp("v4") / "deepseek_v4"
    assert main(["model", "init-tiny", "--arch", "deepseek_v4", "--seed", "5", str(out)]) == 0
    return out


def _runner(ckpt: str, tp: int, rank: int, port: int, block_size: int):
    from engine.parallel import init_tp_group  # noqa: PLC0415
    from engine.v4.runner import V4Runner  # noqa: PLC0415

    group = init_tp_group(rank, tp, "127.0.0.1", port, "gloo", timeout_s=60)
    return V4Runner(ckpt, num_kv_blocks=BLOCKS, block_size=block_size, tp=group), group


def _all_free(runner) -> None:
    """Every V4 group pool block back and no request cache left."""
    held = {name: p.num_blocks - p.num_free_blocks for name, p in runner.pools.items()}
    assert not any(held.values()) and not runner.caches, (held, list(runner.caches))


def prefill_rank(role: str, rank: int, p_tp: int, ckpt: str, port: int, addr_q, first_qs
                 ) -> dict:
    """Prefill every prompt in chunks, stage and send its rows; rank 0 gives the decode ranks
    each request's first token. Returns the connector's stats."""
    runner, group = _runner(ckpt, p_tp, rank, port, P_BLOCK)
    conn = PrefillKVConnector(runner.kv_cache, staged_layout(runner.kv_spec, "v4", p_tp), "p0",
                              rank, p_tp, CFG)
    got = [addr_q.get(timeout=60) for _ in first_qs]
    peers = [KVPeer("d0", d, *addr) for d, addr, _ in sorted(got)]
    tables = got[0][2]  # NOTE: every decode rank took the same blocks
    assert all(t == tables for _, _, t in got)
    pool = BlockPool(BLOCKS, P_BLOCK)
    mine = {i for send in conn.plan(len(peers)).sends_from(rank) for i in send.layers}
    for seed, (rid, n) in enumerate(PROMPTS.items()):
        prompt, blocks = _prompt(n, seed), pool.allocate(-(-n // P_BLOCK))
        for start in range(0, n, CHUNK):
            end = min(n, start + CHUNK)
            logits = runner.execute([SeqStep(rid, prompt[start:end], start, blocks.block_ids)])
            for rows in runner.chunk_rows(n, start, end):  # NOTE: as kv_sends.staged_transfers
                src = slot_mapping(blocks.block_ids, rows.start, rows.end, P_BLOCK)
                runner.stage_rows(rid, n, rows, src, mine)  # NOTE: only the layers it sends
                conn.send_chunk(rid, peers, rows.start, rows.end, src,
                                slot_mapping(tables[rid], rows.start, rows.end, D_BLOCK),
                                layers=rows.layers)
        conn.finish(rid, peers, runner.staged_rows(n))
        if rank == 0:
            for q in first_qs:
                q.put((rid, int(logits[0].argmax())))
        assert conn.wait(rid, 60) == KVStatus(KVPoll.SUCCESS)
        pool.free(blocks)
        runner.release(blocks)
        runner.free_requests(runner.take_releases())  # NOTE: what the rank does at a step
    _all_free(runner)
    conn.close()
    group.destroy()
    return conn.stats.snapshot()


def decode_rank(role: str, rank: int, p_tp: int, d_tp: int, ckpt: str, port: int, addr_qs,
                first_q, released_q) -> dict:
    """Expect every request's rows, rebuild its cache from them, then decode all of them
    together; returns each request's greedy tokens (the first one prefill's). At the end
    only rank 0's pool frees (the leader's): under TP its runner's releases reach the other
    rank as a step frame carries them (``take_releases`` -> ``free_requests``); before that
    nothing is freed on any rank."""
    runner, group = _runner(ckpt, d_tp, rank, port, D_BLOCK)
    conn = DecodeKVConnector(runner.kv_cache, staged_layout(runner.kv_spec, "v4", d_tp), "d0",
                             rank, CFG)
    pool, held, rows = BlockPool(BLOCKS, D_BLOCK), {}, {}
    seen = {rid: torch.zeros(runner.model.config.num_hidden_layers, runner.staged_rows(n),
                             dtype=torch.int32) for rid, n in PROMPTS.items()}
    end_write, counting = conn._tracker.end_write, threading.Lock()

    def counting_end_write(req, chunk, done):  # NOTE: every record written into the slots
        if done:
            with counting:  # NOTE: one receiver thread per prefill rank
                seen[chunk.request_id][list(chunk.layers), chunk.token_start:chunk.token_end] += 1
        end_write(req, chunk, done)

    conn._tracker.end_write = counting_end_write
    for rid, n in PROMPTS.items():
        rows[rid] = runner.staged_rows(n)
        held[rid] = pool.allocate(-(-rows[rid] // D_BLOCK))
        conn.expect(rid, rows[rid], p_tp, layer_tokens=runner.layer_rows(n))
    for q in addr_qs:
        q.put((rank, conn.address, {rid: b.block_ids for rid, b in held.items()}))
    for rid, n in PROMPTS.items():
        assert wait_settled(conn, rid, 60) == KVStatus(KVPoll.SUCCESS), rid
        ids = held[rid].block_ids
        runner.admit_staged(rid, ids, slot_mapping(ids, 0, rows[rid], D_BLOCK), n)
        conn.release(rid)
        want = torch.zeros_like(seen[rid])
        for layer, own in enumerate(runner.layer_rows(n)):
            want[layer, :own] = 1
        assert torch.equal(seen[rid], want), (rid, (seen[rid] != want).nonzero()[:5])
    tokens = {rid: [tok] for rid, tok in (first_q.get(timeout=60) for _ in PROMPTS)}
    for i in range(NEW - 1):
        steps = [SeqStep(rid, (tokens[rid][-1],), n + i, held[rid].block_ids)
                 for rid, n in PROMPTS.items()]
        for rid, row in zip(PROMPTS, runner.execute(steps)):
            tokens[rid].append(int(row.argmax()))
    if rank == 0:
        for blocks in held.values():
            pool.free(blocks)
            runner.release(blocks)
        runner.apply_releases()
        assert bool(runner.caches) == (d_tp > 1)  # NOTE: under TP only with the step's list
        released = runner.take_releases() if d_tp > 1 else ()
        for _ in range(d_tp - 1):
            released_q.put(released)
    else:
        released = released_q.get(timeout=60)
    assert sorted(released) == (sorted(PROMPTS) if d_tp > 1 else [])
    runner.free_requests(released)
    _all_free(runner)
    conn.close()
    group.destroy()
    return tokens, conn.stats.snapshot()["bytes"]


@pytest.mark.parametrize("p_tp,d_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_v4_pd_across_tp_equals_colocated(p_tp, d_tp, v4_ckpt):
    ckpt = str(v4_ckpt)
    addr_qs, first_qs = [CTX.Queue() for _ in range(p_tp)], [CTX.Queue() for _ in range(d_tp)]
    released_q = CTX.Queue()
    p_port, d_port = free_port(), free_port()
    out = run_ranks([(prefill_rank, ("prefill", p, p_tp, ckpt, p_port, addr_qs[p], first_qs))
                     for p in range(p_tp)]
                    + [(decode_rank, ("decode", d, p_tp, d_tp, ckpt, d_port, addr_qs,
                                      first_qs[d], released_q)) for d in range(d_tp)],
                    timeout_s=180)
    errors = {k: err for k, (err, _) in out.items() if err}
    assert not errors and len(out) == p_tp + d_tp, errors or sorted(out)
    torch.set_num_threads(1)
    want = {rid: _solo_greedy(v4_ckpt, _prompt(n, seed), NEW)
            for seed, (rid, n) in enumerate(PROMPTS.items())}
    for d in range(d_tp):
        assert out[("decode", d)][1][0] == want, f"decode rank {d}"
    # NOTE: bytes: every decode rank gets every layer's rows once, split over the senders
    from engine.v4.config import V4Config  # noqa: PLC0415
    from engine.v4.staging import kind_widths, layer_rows  # noqa: PLC0415

    import json  # noqa: PLC0415

    config = V4Config.from_dict(json.loads((v4_ckpt / "config.json").read_text()))
    widths = kind_widths(config)
    per_layer = [sum(layer_rows(config, n)[i] for n in PROMPTS.values()) * widths[k] * 4
                 for i, k in enumerate(config.layer_types)]  # NOTE: own rows x fp32 row bytes
    sent = [out[("prefill", p)][1]["bytes"] for p in range(p_tp)]
    assert sum(sent) == d_tp * sum(per_layer), sent
    assert [out[("decode", d)][1][1] for d in range(d_tp)] == [sum(per_layer)] * d_tp
    if p_tp == 2:  # layers 0-1 from rank 0, 2-3 from rank 1 (kv_transfer/plan.py)
        assert sent == [sum(per_layer[:2]), sum(per_layer[2:])]

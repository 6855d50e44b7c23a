"""Prefix cache benchmark on the Mooncake conversation trace (CPU, tiny model, ranks in-process).

The trace (``../shared/data/mooncake_conversation_trace.jsonl``, Kimi, Apache-2.0) gives each
request its 512-token prefix blocks as ``hash_ids`` (equal leading ids = shared prefix). Scaled
to the tiny model: one trace block -> one KV block of ``BLOCK`` = 16 tokens (lengths / 32), the
block's token ids drawn from a generator seeded by its hash id, so shared blocks are shared
tokens and the prefix structure is preserved exactly. Prompts longer than ``--max-blocks``
blocks are cut (the report says how many). Each request asks for one token (TTFT is what the
cache changes; decode is unchanged).

Runs, all in one process and session (ratios against the cache-off run of the same requests):

1. one instance, cache off vs on (pool large enough for the working set): token hit rate vs
   the trace's ideal (every repeated leading block hit, the last prompt token always
   computed), TTFT p50 / mean;
2. two instances (prefill dp 2), cache on: ``round_robin`` vs ``kv_aware`` (the router's
   policy object and KV index, fed by the instances' KV events): hit rate and TTFT;
3. multi-turn PD (prefill + decode ranks): conversations of ``--turns`` turns, each turn =
   previous turn's prompt + its output + new user tokens; KV bytes prefill ships per request
   with the decode side's cache off vs on.

Requests of one trace tick (same timestamp) are submitted together; ticks run one after
another (the time between ticks is not replayed). Not a test; run:
``PYTHONPATH=. python benchmarks/prefix_cache_bench.py`` (docs/prefix_cache.md has the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.policies import make_policy
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Abort, Admit, Generate, Prefill, Reserve
from rank.rank import Rank

BLOCK = 16
TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / \
    "mooncake_conversation_trace.jsonl"
VOCAB = 129280


@dataclass(frozen=True)
class TraceRequest:
    """One scaled trace request: arrival tick (ms), prompt token ids, trace prefix blocks."""

    tick: int
    prompt: tuple[int, ...]
    hash_ids: tuple[int, ...]


def block_tokens(hash_id: int) -> list[int]:
    """The ``BLOCK`` token ids standing for trace block ``hash_id``."""
    gen = torch.Generator().manual_seed(hash_id)
    return torch.randint(2, VOCAB, (BLOCK,), generator=gen).tolist()


def load_trace(path: Path, n: int, max_blocks: int) -> tuple[list[TraceRequest], int]:
    """The first ``n`` requests, scaled; and how many were cut to ``max_blocks`` blocks."""
    out, cut = [], 0
    with path.open() as f:
        for line in f:
            if len(out) == n:
                break
            row = json.loads(line)
            length = max(1, -(-row["input_length"] // 32))
            ids = row["hash_ids"][:max_blocks]
            if length > max_blocks * BLOCK:
                cut, length = cut + 1, max_blocks * BLOCK
            tokens = [t for h in ids for t in block_tokens(h)][:length]
            out.append(TraceRequest(row["timestamp"], tuple(tokens), tuple(ids)))
    return out, cut


def ideal_hit_rate(reqs: list[TraceRequest]) -> float:
    """Prompt tokens an unbounded cache would hit / all prompt tokens: the leading blocks whose
    hash ids were all seen before, at most ``(prompt - 1) // BLOCK`` (the last token is always
    computed)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in reqs:
        full = min((len(r.prompt) - 1) // BLOCK, len(r.hash_ids))
        n = 0
        while n < full and tuple(r.hash_ids[:n + 1]) in seen:
            n += 1
        hit, total = hit + n * BLOCK, total + len(r.prompt)
        seen.update(tuple(r.hash_ids[:k + 1]) for k in range(len(r.prompt) // BLOCK))
    return hit / total


def start(ckpt: Path, role_cls, name: str, role: str, blocks: int, cache: bool) -> Rank:
    """One TP=1 rank (its own loop thread) of ``role``."""
    sched = SchedulerConfig(block_size=BLOCK, num_kv_blocks=blocks, chunk_size=512,
                            max_num_batched_tokens=512, max_num_seqs=16, prefix_cache=cache)
    cfg = InstanceConfig(name=name, role=role, checkpoint_dir=str(ckpt), scheduler=sched)
    rank = Rank(cfg, 0, role_cls)
    host, port = rank.open_tp_store()
    rank.init_rank(host, port, [rank])
    rank.start()
    return rank


def wait_first(ranks: list[Rank], pending: dict[str, float], index: KVIndex | None
               ) -> dict[str, float]:
    """request id -> TTFT (s) of every id in ``pending`` (id -> submit time), polling every
    rank (their KV events go to ``index``)."""
    ttft: dict[str, float] = {}
    deadline = time.monotonic() + 600
    while len(ttft) < len(pending):
        assert time.monotonic() < deadline, "requests did not finish within 600 s"
        for rank in ranks:
            for ev in rank.poll(0.01, True):
                if ev.kv_events is not None:
                    if index is not None:
                        index.apply(ev.instance, ev.kv_events)
                elif ev.request_id in pending and ev.request_id not in ttft:
                    assert ev.error is None, ev.error
                    ttft[ev.request_id] = time.monotonic() - pending[ev.request_id]
    return ttft


def replay(ranks: list[Rank], reqs: list[TraceRequest], policy_name: str) -> dict:
    """Submit tick by tick through ``policy_name`` over ``ranks``; hit rate and TTFTs."""
    index = KVIndex()
    names = [r.cfg.name for r in ranks]
    policy = make_policy(policy_name, names, index=index)
    by_name = dict(zip(names, ranks))
    ttfts, i = [], 0
    while i < len(reqs):
        tick = [r for r in reqs[i:] if r.tick == reqs[i].tick]
        pending, placed = {}, []
        for j, r in enumerate(tick):
            rid = f"q{i + j}"
            name = policy.order(r.prompt)[0]
            policy.acquire(name, len(r.prompt))
            placed.append((name, len(r.prompt)))
            by_name[name].request(Generate(RequestSpec(rid, r.prompt, SamplingParams(
                max_tokens=1, ignore_eos=True))))
            pending[rid] = time.monotonic()
        ttfts += wait_first(ranks, pending, index).values()
        for name, load in placed:
            policy.release(name, load)
        i += len(tick)
    hits = sum(r.leader.pool.lookup_totals()[1] for r in ranks)
    queried = sum(r.leader.pool.lookup_totals()[0] for r in ranks)
    return {"hit": hits / queried, "ttft_p50": statistics.median(ttfts),
            "ttft_mean": statistics.fmean(ttfts)}


def single(ckpt: Path, reqs: list[TraceRequest], blocks: int) -> dict[bool, dict]:
    out = {}
    for cache in (False, True):
        rank = start(ckpt, ColocatedRole, "colocated-0", "colocated", blocks, cache)
        try:
            out[cache] = replay([rank], reqs, "least_outstanding_tokens")
        finally:
            rank.shutdown()
    return out


def dp2(ckpt: Path, reqs: list[TraceRequest], blocks: int) -> dict[str, dict]:
    out = {}
    for policy in ("round_robin", "kv_aware"):
        ranks = [start(ckpt, ColocatedRole, f"prefill-{i}", "colocated", blocks, True)
                 for i in range(2)]
        try:
            out[policy] = replay(ranks, reqs, policy)
        finally:
            for r in ranks:
                r.shutdown()
    return out


def pd_turn(prefill: Rank, decode: Rank, spec: RequestSpec) -> list[int]:
    """One request through reserve -> prefill -> admit -> decode; its tokens."""
    res = decode.request(Reserve(spec, 1))
    prefill.request(Prefill(spec, res))
    tokens = collect(prefill, spec.request_id)
    if len(tokens) >= spec.sampling.max_tokens:
        decode.request(Abort(spec.request_id))
        return tokens
    decode.request(Admit(spec.request_id, tokens[0]))
    return tokens + collect(decode, spec.request_id)


def collect(rank: Rank, rid: str) -> list[int]:
    tokens, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline:
        for ev in rank.poll(0.05):
            if ev.request_id == rid:
                assert ev.error is None, ev.error
                tokens += ev.token_ids
                if ev.finish_reason is not None or ev.source == "prefill":
                    return tokens
    raise TimeoutError(rid)


def multiturn(ckpt: Path, reqs: list[TraceRequest], turns: int, out_len: int) -> dict:
    """KV bytes shipped per request, decode cache off vs on (prefill cache on in both)."""
    out = {}
    for decode_cache in (False, True):
        prefill = start(ckpt, PrefillRole, "prefill-0", "prefill", 512, True)
        decode = start(ckpt, DecodeRole, "decode-0", "decode", 512, decode_cache)
        try:
            n = 0
            for c, first in enumerate(reqs):
                prompt = list(first.prompt)
                for t in range(turns):
                    spec = RequestSpec(f"c{c}t{t}", tuple(prompt), SamplingParams(
                        max_tokens=out_len, ignore_eos=True))
                    prompt += pd_turn(prefill, decode, spec) + block_tokens(10**6 + n)[:5]
                    n += 1
            time.sleep(0.5)
            out[decode_cache] = prefill.status().kv_bytes_sent / n
        finally:
            prefill.shutdown()
            decode.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--max-blocks", type=int, default=24)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    reqs, cut = load_trace(args.trace, args.requests, args.max_blocks)
    blocks = sum(len(r.prompt) // BLOCK + 1 for r in reqs) + 16  # holds the working set
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        one = single(ckpt, reqs, blocks)
        two = dp2(ckpt, reqs, blocks)
        turns = multiturn(ckpt, reqs[:args.conversations], args.turns, out_len=8)
    ideal = ideal_hit_rate(reqs)
    print(f"{len(reqs)} Mooncake conversation requests ({cut} cut to {args.max_blocks} "
          f"blocks), prompt tokens {sum(len(r.prompt) for r in reqs)}, ideal hit rate "
          f"{ideal:.3f}")
    print("| run | hit rate | of ideal | TTFT p50 ms | TTFT mean ms | TTFT p50 ratio |")
    print("|---|---|---|---|---|---|")
    base = one[False]["ttft_p50"]
    rows = [("1 instance, cache off", one[False]), ("1 instance, cache on", one[True]),
            ("dp 2, round_robin", two["round_robin"]), ("dp 2, kv_aware", two["kv_aware"])]
    for name, r in rows:
        print(f"| {name} | {r['hit']:.3f} | {r['hit'] / ideal:.2f} | {1e3 * r['ttft_p50']:.1f} "
              f"| {1e3 * r['ttft_mean']:.1f} | {r['ttft_p50'] / base:.2f} |")
    ratio = two["kv_aware"]["hit"] / max(two["round_robin"]["hit"], 1e-9)
    print(f"\nkv_aware / round_robin hit rate: {ratio:.2f}x; TTFT p50 "
          f"{two['kv_aware']['ttft_p50'] / two['round_robin']['ttft_p50']:.2f}x")
    print(f"\nmulti-turn PD ({args.conversations} conversations x {args.turns} turns): KV bytes "
          f"shipped per request: decode cache off {turns[False]:.0f}, on {turns[True]:.0f} "
          f"({turns[True] / turns[False]:.2f}x)")


if __name__ == "__main__":
    main()

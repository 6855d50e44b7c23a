"""Prefix cache benchmark on the Mooncake conversation trace (CPU, tiny model, ranks in-process).

The trace sample and its scaling (prefix structure kept exactly): ``prefix_trace.py``.
Each request asks for one token (TTFT is what the cache changes; decode is unchanged).

Runs, all in one process and session (ratios against the cache-off run of the same requests):

1. one instance, cache off vs on (pool large enough for the working set): token hit rate vs
   the trace's ideal (every repeated leading block hit, the last prompt token always
   computed), TTFT p50 / mean;
2. ``--dp`` instances (default 2: prefill dp 2), cache on: ``round_robin`` vs ``kv_aware``
   (the router's policy object and KV index, fed by the instances' KV events): hit rate and
   TTFT; ``--kv-blocks N`` bounds each routed instance's KV pool (its prefix cache) at N
   blocks (``prefix_cache_bounded.py`` replays the same offline), ``--routed-only`` skips 1
   (1 and 2 run interleaved tick by tick, all instances alive at once: ratios in one window);
3. multi-turn PD (prefill + decode ranks): conversations of ``--turns`` turns, each turn =
   previous turn's prompt + its output + new user tokens; KV bytes prefill ships per request
   with the decode side's cache off vs on.

Requests of one trace tick (same timestamp) are submitted together; ticks run one after
another (the time between ticks is not replayed: no queueing; ``prefix_cache_load.py``
replays at a given arrival rate). Not a test; run:
``PYTHONPATH=. python benchmarks/prefix_cache_bench.py`` (docs/prefix_cache.md has the table).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.prefix_trace import (BLOCK, TRACE_BLOCK, add_sample_args, TraceRequest,
                                     block_tokens, ideal_hit_rate, load_trace, start)
from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.policies import make_policy
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.colocated import ColocatedRole
from rank.messages import Abort, Admit, Generate, Prefill, Reserve
from rank.rank import Rank

def wait_first(ranks: list[Rank], pending: dict[str, float], index: KVIndex | None
               ) -> dict[str, float]:
    """request id -> TTFT (s) of every id in ``pending`` (id -> submit time), polling every
    rank (their KV events go to ``index``)."""
    ttft: dict[str, float] = {}
    deadline = time.monotonic() + 600
    while len(ttft) < len(pending):
        assert time.monotonic() < deadline, "requests did not finish within 600 s"
        for rank in ranks:
            for ev in rank.poll(0.002, True):
                if ev.kv_events is not None:
                    if index is not None:
                        index.apply(ev.instance, ev.kv_events)
                elif ev.request_id in pending and ev.request_id not in ttft:
                    assert ev.error is None, ev.error
                    ttft[ev.request_id] = time.monotonic() - pending[ev.request_id]
    return ttft


@dataclass
class Setup:
    """One configuration replayed: its instances, the router policy over them and its KV
    index (fed by their events), and the TTFTs measured."""

    ranks: list[Rank]
    policy_name: str
    index: KVIndex = field(default_factory=KVIndex)
    ttfts: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.policy = make_policy(self.policy_name, [r.cfg.name for r in self.ranks],
                                  index=self.index)

    def run_tick(self, first: int, tick: list[TraceRequest]) -> None:
        """Submit one tick's requests (ids from ``first``) and wait for their first tokens."""
        by_name = {r.cfg.name: r for r in self.ranks}
        pending, placed = {}, []
        for j, r in enumerate(tick):
            rid = f"q{first + j}"
            name = self.policy.order(r.prompt)[0]
            load = self.policy.load_for(name, len(r.prompt), r.prompt)  # as the router's flow
            self.policy.acquire(name, load)
            placed.append((name, load))
            by_name[name].request(Generate(RequestSpec(rid, r.prompt, SamplingParams(
                max_tokens=1, ignore_eos=True))))
            pending[rid] = time.monotonic()
        self.ttfts += wait_first(self.ranks, pending, self.index).values()
        for name, load in placed:
            self.policy.release(name, load)

    def result(self) -> dict:
        queried = sum(r.leader.pool.lookup_totals()[0] for r in self.ranks)
        hits = sum(r.leader.pool.lookup_totals()[1] for r in self.ranks)
        return {"hit": hits / max(queried, 1), "ttft_p50": statistics.median(self.ttfts),
                "ttft_mean": statistics.fmean(self.ttfts)}


def replay(ckpt: Path, reqs: list[TraceRequest], blocks: int, dp: int,
           routed_blocks: int | None = None, routed_only: bool = False) -> dict[str, dict]:
    """Every configuration (the routed ones over ``dp`` instances of ``routed_blocks`` KV
    blocks each, default ``blocks``) over the same requests, INTERLEAVED tick by tick (each
    tick runs on one configuration after the other), so a change of machine load hits all
    alike. ``routed_only``: without the two single-instance runs."""
    def ranks(prefix: str, n: int, cache: bool, size: int = blocks) -> list[Rank]:
        return [start(ckpt, ColocatedRole, f"{prefix}-{i}", "colocated", size, cache)
                for i in range(n)]

    size = routed_blocks or blocks
    setups = {} if routed_only else {
        "1 instance, cache off": Setup(ranks("off", 1, False), "round_robin"),
        "1 instance, cache on": Setup(ranks("on", 1, True), "round_robin")}
    setups["round_robin"] = Setup(ranks("rr", dp, True, size), "round_robin")
    setups["kv_aware"] = Setup(ranks("kv", dp, True, size), "kv_aware")
    try:
        i = 0
        while i < len(reqs):
            tick = [r for r in reqs[i:] if r.tick == reqs[i].tick]
            for setup in setups.values():
                setup.run_tick(i, tick)
            i += len(tick)
        return {name: setup.result() for name, setup in setups.items()}
    finally:
        for setup in setups.values():
            for rank in setup.ranks:
                rank.shutdown()


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
    add_sample_args(ap)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--dp", type=int, default=2, help="instances the routed runs use")
    ap.add_argument("--skip-multiturn", action="store_true")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="KV blocks (the prefix cache's bound) of each routed instance; "
                         "default: the working set plus a tick's requests, as the others")
    ap.add_argument("--routed-only", action="store_true",
                    help="only the routed runs (round_robin vs kv_aware), no single instance")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reqs, cut = load_trace(args.trace, args.requests, args.max_blocks, args.every)
    ideal, distinct = ideal_hit_rate(reqs)
    # NOTE: holds the working set (every distinct block) plus one tick's requests in flight
    blocks = distinct + 8 * (args.max_blocks * TRACE_BLOCK // BLOCK + 1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        load = os.getloadavg()[0]
        runs = replay(ckpt, reqs, blocks, args.dp, args.kv_blocks, args.routed_only)
        load = (load, os.getloadavg()[0])
        turns = (None if args.skip_multiturn else
                 multiturn(ckpt, reqs[:args.conversations], args.turns, out_len=8))
    print(f"{len(reqs)} Mooncake conversation requests (one conversation in {args.every}; "
          f"{cut} cut to {args.max_blocks} blocks), prompt tokens {sum(len(r.prompt) for r in reqs)}, ideal hit rate "
          f"{ideal:.3f}")
    print(f"routed instances: {args.kv_blocks or blocks} KV blocks each (working set "
          f"{distinct} blocks); load average {load[0]:.1f} at the start, {load[1]:.1f} at "
          "the end")
    ref = "round_robin" if args.routed_only else "1 instance, cache off"
    print(f"| run | hit rate | of ideal | TTFT p50 ms | TTFT mean ms | TTFT p50 / {ref} |")
    print("|---|---|---|---|---|---|")
    base = runs[ref]["ttft_p50"]
    for name, r in runs.items():
        name = name if name.startswith("1 ") else f"dp {args.dp}, {name}"
        print(f"| {name} | {r['hit']:.3f} | {r['hit'] / ideal:.2f} | {1e3 * r['ttft_p50']:.1f} "
              f"| {1e3 * r['ttft_mean']:.1f} | {r['ttft_p50'] / base:.2f} |")
    rr, kv = runs["round_robin"], runs["kv_aware"]
    print(f"\nkv_aware / round_robin hit rate: {kv['hit'] / max(rr['hit'], 1e-9):.2f}x; TTFT "
          f"p50 {kv['ttft_p50'] / rr['ttft_p50']:.2f}x, mean "
          f"{kv['ttft_mean'] / rr['ttft_mean']:.2f}x")
    if turns is None:
        return
    print(f"\nmulti-turn PD ({args.conversations} conversations x {args.turns} turns): KV bytes "
          f"shipped per request: decode cache off {turns[False]:.0f}, on {turns[True]:.0f} "
          f"({turns[True] / turns[False]:.2f}x)")


if __name__ == "__main__":
    main()

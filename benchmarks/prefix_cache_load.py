"""TTFT with the prefix cache on vs off under load: the Mooncake conversation trace at a given
arrival rate (CPU, tiny model, colocated ranks in-process).

``prefix_cache_bench.py`` replays the trace tick by tick with nothing queued, so the cache
saves only the prefill compute of the tokens it holds (a third of this trace's). Under load a
request also waits for the ones ahead of it, and that wait grows steeply as the instance
nears its capacity; the cache shortens every request's prefill, so near the cache-off
instance's capacity it cuts the wait far more than the compute. This replays the same sample
(``prefix_trace.py``, prefix structure kept) open loop:

1. capacity: every request submitted at once to a fresh instance alone, cache off and on
   (alternating, ``--reps`` each): requests per second until the last first token;
2. for each ``--load`` fraction f: Poisson arrivals (seeded, the same times for both) at
   f x the cache-off capacity (median of step 1), in the trace's order, to two fresh
   instances side by side in this process, one with the cache off and one with it on
   (``--reps`` pairs; which one gets each request first alternates), so the machine's other
   jobs (it is shared, and its free CPU moves by 2x within seconds) hit both alike; TTFT =
   first token seen - scheduled arrival. Each run reports its utilisation (step seconds /
   wall: the load it actually ran at) and the load average at its end.
   ``--one-after-the-other`` runs them alternately instead (exposed to that drift).

The trace's own timestamps are not replayed (they come in 3 s ticks); only its order is.
Each request asks for one token. Not a test; run:
``PYTHONPATH=. python benchmarks/prefix_cache_load.py`` (docs/prefix_cache.md has the table).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.prefix_trace import (BLOCK, TRACE_BLOCK, add_sample_args, TraceRequest,
                                     block_tokens, ideal_hit_rate, load_trace, start)
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.tiny_model import write_tiny_checkpoint
from rank.colocated import ColocatedRole
from rank.messages import Generate
from rank.rank import Rank


@dataclass(frozen=True)
class Run:
    """One replay on a fresh instance: TTFTs (s, in request order), token hit rate, wall
    time (s) from the first arrival to the last first token, the share of it the instance
    spent in steps (its utilisation: the load it ran at, relative to its capacity at the
    time), 1-minute load average at its end."""

    ttfts: tuple[float, ...]
    hit: float
    wall_s: float
    busy: float
    loadavg: float

    def pct(self, q: float) -> float:
        """The ``q`` quantile of the TTFTs, s (nearest rank)."""
        ordered = sorted(self.ttfts)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of ``n`` requests of a Poisson process of ``rate``
    requests per second; 0 for every one when ``rate`` is infinite (all at once)."""
    if rate == float("inf"):
        return [0.0] * n
    gen, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += gen.expovariate(rate)
    return out


def open_loop(ranks: list[Rank], reqs: list[TraceRequest], offsets: list[float],
              tag: str = "r") -> list[tuple[list[float], float]]:
    """Submit request i (id ``tag`` + i) to every rank at ``offsets[i]`` s from now,
    whatever is still running (the ranks in turn, the first one rotating); per rank, each
    request's TTFT (s from its scheduled arrival to its first token seen here) and the time
    (s) from the first arrival to its last first token."""
    t0 = time.monotonic()
    due = [t0 + o for o in offsets]
    first: list[dict[int, float]] = [{} for _ in ranks]
    nxt, deadline = 0, due[-1] + 600
    while any(len(f) < len(reqs) for f in first):
        now = time.monotonic()
        assert now < deadline, "requests did not finish within 600 s of the last arrival"
        while nxt < len(reqs) and due[nxt] <= now:
            spec = RequestSpec(f"{tag}{nxt}", reqs[nxt].prompt,
                               SamplingParams(max_tokens=1, ignore_eos=True))
            for k in range(len(ranks)):
                ranks[(nxt + k) % len(ranks)].request(Generate(spec))
            nxt += 1
        wait = 0.002 if nxt == len(reqs) else min(0.002, max(0.0, due[nxt] - now))
        for rank, got in zip(ranks, first):
            for ev in rank.poll(wait / len(ranks)):
                assert ev.error is None, ev.error
                if ev.request_id.startswith(tag):
                    i = int(ev.request_id[len(tag):])
                    got.setdefault(i, time.monotonic() - due[i])
    return [([got[i] for i in range(len(reqs))], max(got[i] + offsets[i] for i in got))
            for got in first]


def warm_up(ranks: list[Rank]) -> None:
    """One request of tokens no trace block has (torch's first-call costs paid here)."""
    prompt = tuple(t for k in range(16) for t in block_tokens(10**9 + k))
    open_loop(ranks, [TraceRequest(0, prompt, ())], [0.0], tag="warm-up")


def measure(ckpt: Path, blocks: int, caches: tuple[bool, ...], reqs: list[TraceRequest],
            offsets: list[float]) -> list[Run]:
    """One replay of ``reqs`` at ``offsets`` on fresh colocated instances, one per entry of
    ``caches`` (prefix cache on / off), side by side: the same arrivals at the same moments,
    so the machine's other load hits them alike."""
    ranks = []
    try:
        for k, cache in enumerate(caches):
            ranks.append(start(ckpt, ColocatedRole, f"cache-{'on' if cache else 'off'}-{k}",
                               "colocated", blocks, cache))
        warm_up(ranks)
        before = [(r.leader.pool.lookup_totals(), r.leader.step_timer.snapshot().step.total_s)
                  for r in ranks]
        results = open_loop(ranks, reqs, offsets)
        out = []
        for rank, ((queried0, hits0), busy0), (ttfts, wall) in zip(ranks, before, results):
            queried, hits = rank.leader.pool.lookup_totals()
            busy = rank.leader.step_timer.snapshot().step.total_s - busy0
            out.append(Run(tuple(ttfts), (hits - hits0) / max(queried - queried0, 1), wall,
                           busy / wall, os.getloadavg()[0]))
        return out
    finally:
        for rank in ranks:
            rank.shutdown()


def alternate(ckpt: Path, blocks: int, reqs: list[TraceRequest], offsets: list[float],
              reps: int, side_by_side: bool) -> dict[bool, list[Run]]:
    """``reps`` runs cache off and on: one after the other, alternating (off-on, on-off,
    ...), or ``side_by_side`` (the first to get each request alternating likewise)."""
    out: dict[bool, list[Run]] = {False: [], True: []}
    for rep in range(reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        groups = [order] if side_by_side else [(c,) for c in order]
        for caches in groups:
            for cache, run in zip(caches, measure(ckpt, blocks, caches, reqs, offsets)):
                out[cache].append(run)
    return out


def report_capacity(runs: dict[bool, list[Run]], n: int) -> float:
    """Print the saturated throughput of each run; the cache-off median (requests/s)."""
    print("| capacity run | cache off req/s | cache on req/s | load avg off / on |")
    print("|---|---|---|---|")
    for k, (off, on) in enumerate(zip(runs[False], runs[True])):
        print(f"| {k + 1} | {n / off.wall_s:.2f} | {n / on.wall_s:.2f} | "
              f"{off.loadavg:.1f} / {on.loadavg:.1f} |")
    return statistics.median(n / r.wall_s for r in runs[False])


def report_load(load: str, rate: float, runs: dict[bool, list[Run]]) -> None:
    """One table row per pair of runs at ``rate`` (``load``: x the cache-off capacity, or
    "-" for a rate given in requests/s)."""
    for off, on in zip(runs[False], runs[True]):
        print(f"| {load} | {rate:.2f} | {1e3 * off.pct(0.5):.0f} / {1e3 * off.pct(0.9):.0f} "
              f"| {1e3 * on.pct(0.5):.0f} / {1e3 * on.pct(0.9):.0f} | {on.hit:.3f} "
              f"| **{on.pct(0.5) / off.pct(0.5):.2f}** / {on.pct(0.9) / off.pct(0.9):.2f} "
              f"| {off.busy:.2f} / {on.busy:.2f} | {off.loadavg:.1f} / {on.loadavg:.1f} |")


def summarize(results: list[tuple[str, dict[bool, list[Run]]]]) -> None:
    """Per load: the median over the pairs of the on / off TTFT ratios and of the cache-off
    instance's utilisation."""
    print("\n| load (x cache-off capacity) or rate | pairs | on / off TTFT p50, median (range) "
          "| on / off TTFT p90, median | cache-off busy, median |")
    print("|---|---|---|---|---|")
    for load, runs in results:
        pairs = list(zip(runs[False], runs[True]))
        p50 = [on.pct(0.5) / off.pct(0.5) for off, on in pairs]
        p90 = [on.pct(0.9) / off.pct(0.9) for off, on in pairs]
        print(f"| {load} | {len(pairs)} | **{statistics.median(p50):.2f}** "
              f"({min(p50):.2f}-{max(p50):.2f}) | {statistics.median(p90):.2f} "
              f"| {statistics.median(off.busy for off, _ in pairs):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sample_args(ap)
    ap.add_argument("--load", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8],
                    help="arrival rates as fractions of the cache-off capacity")
    ap.add_argument("--rate", type=float, nargs="*", default=[],
                    help="arrival rates in requests/s instead of --load (skips step 1)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--one-after-the-other", action="store_true",
                    help="loaded runs one instance at a time (default: off and on side by side)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    reqs, cut = load_trace(args.trace, args.requests, args.max_blocks, args.every)
    ideal, distinct = ideal_hit_rate(reqs)
    # NOTE: holds the working set plus a full batch (max_num_seqs 16) of the longest prompts
    blocks = distinct + 16 * (args.max_blocks * TRACE_BLOCK // BLOCK + 1)
    print(f"{len(reqs)} Mooncake conversation requests (one conversation in {args.every}; "
          f"{cut} cut to {args.max_blocks} blocks), prompt tokens "
          f"{sum(len(r.prompt) for r in reqs)}, ideal hit rate {ideal:.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        rates = [(None, r) for r in args.rate]
        if not rates:
            at_once = poisson_offsets(len(reqs), float("inf"), args.seed)
            cap = report_capacity(alternate(ckpt, blocks, reqs, at_once, args.reps, False),
                                  len(reqs))
            rates = [(f, f * cap) for f in args.load]
        print("\n| load (x cache-off capacity) | rate req/s | cache off TTFT p50 / p90 ms "
              "| cache on TTFT p50 / p90 ms | hit rate | on / off p50 / p90 | busy off / on "
              "| load avg off / on |")
        print("|---|---|---|---|---|---|---|---|")
        results = []
        for frac, rate in rates:
            runs = alternate(ckpt, blocks, reqs, poisson_offsets(len(reqs), rate, args.seed),
                             args.reps, not args.one_after_the_other)
            load = "-" if frac is None else f"{frac:.2f}"
            report_load(load, rate, runs)
            results.append((load if frac is not None else f"{rate:g} req/s", runs))
        summarize(results)


if __name__ == "__main__":
    main()

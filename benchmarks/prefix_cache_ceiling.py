"""What routing can gain on the Mooncake conversation trace, from its ``hash_ids`` alone.

No model, no ranks: each request's prompt is replayed against unbounded prefix caches, one
per instance, in trace order, under three placements:

- ``one cache``: a single instance (the trace's ideal hit rate);
- ``round_robin``: request i on instance ``i mod dp``;
- ``longest prefix``: each request where the most of its prefix is cached (ties rotate), the
  best any cache-aware router can do without regard to load.

Tokens are counted as ``prefix_cache_bench.py`` scales and serves them (``prefix_trace.py``:
a trace block = ``TRACE_BLOCK`` tokens, prompts cut to ``--max-blocks`` blocks, KV blocks of
``BLOCK`` tokens, the cached part of a partial last block included, the last prompt token
always computed), so ``--every 16 --requests 260`` gives the benchmark's ideal hit rate.

No placement over ``dp`` caches can hit more than one cache holding everything; so
``one cache / round_robin`` bounds the ratio any router reaches over round robin. The table
splits the hits by the request's turn in its conversation (1 = a conversation's first
request: it can only hit the system-prompt block every request shares), which says why
round robin keeps most of the reuse: a later turn also finds the earlier turns' prefix
(most of its own) on an instance an earlier turn went to. Run:
``PYTHONPATH=. python benchmarks/prefix_cache_ceiling.py [--every 1 --requests 0]``
(``--offset 0 1 ... 15``: each of the disjoint samples, one line each). Caches bounded at a
KV pool's size (round robin then holds copies of the same prefixes on every instance):
``prefix_cache_bounded.py``.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass

from benchmarks.prefix_trace import (BLOCK, TRACE_BLOCK, add_sample_args, sample_rows,
                                     scaled_length)

POLICIES = ("one cache", "round_robin", "longest prefix")


@dataclass(frozen=True)
class Prompt:
    """One scaled request: prompt tokens, its trace blocks' chained keys, its conversation
    turn (1 = first)."""

    length: int
    keys: tuple[int, ...]
    turn: int


def prompts(trace, requests: int, every: int, max_blocks: int,
            offset: int = 0) -> list[Prompt]:
    """The benchmark's sample as :class:`Prompt` s; a trace block's key names its whole
    prefix, as the engine's chained block hash does."""
    out, turns = [], Counter()
    for row in sample_rows(trace, requests, every, offset):
        keys, key = [], 0
        for h in row.hash_ids[:max_blocks]:
            key = hash((key, h))
            keys.append(key)
        conversation = row.hash_ids[min(1, len(row.hash_ids) - 1)]
        turns[conversation] += 1
        out.append(Prompt(scaled_length(row, max_blocks), tuple(keys), turns[conversation]))
    return out


def cached_tokens(cache: dict[int, int], p: Prompt) -> int:
    """Tokens of ``p`` a cache (trace-block key -> its tokens cached, whole KV blocks) would
    serve: the leading blocks it holds, at most ``(length - 1) // BLOCK`` KV blocks."""
    got = 0
    for key in p.keys:
        held = cache.get(key, 0)
        got += held
        if held < TRACE_BLOCK:
            break
    return min(got, (p.length - 1) // BLOCK * BLOCK)


def store(cache: dict[int, int], p: Prompt) -> None:
    """Cache every full KV block of ``p`` (a partial last trace block: its full KV blocks)."""
    for j, key in enumerate(p.keys):
        full = min(TRACE_BLOCK, p.length - j * TRACE_BLOCK) // BLOCK * BLOCK
        if full > 0:
            cache[key] = max(cache.get(key, 0), full)


def replay(reqs: list[Prompt], dp: int, policy: str) -> Counter:
    """Hit tokens per turn (key ``turn``, turns past 3 as 3) and prompt tokens per turn
    (key ``("all", turn)``) of ``policy`` over ``dp`` unbounded caches."""
    caches: list[dict[int, int]] = [{} for _ in range(dp)]
    out: Counter = Counter()
    for i, p in enumerate(reqs):
        if policy == "round_robin":
            k = i % dp
        else:
            hits = [cached_tokens(c, p) for c in caches]
            k = max(range(dp), key=lambda j: (hits[j], -((j - i) % dp)))
        turn = min(p.turn, 3)
        out[turn] += cached_tokens(caches[k], p)
        out[("all", turn)] += p.length
        store(caches[k], p)
    return out


def hit_rate(r: Counter, total: int) -> float:
    """Hit tokens of a :func:`replay` over ``total`` prompt tokens."""
    return sum(r[t] for t in (1, 2, 3)) / total


def table(reqs: list[Prompt], dps: list[int]) -> None:
    """Every placement at every dp, hits split by turn."""
    total = sum(p.length for p in reqs)
    share = {t: sum(p.length for p in reqs if min(p.turn, 3) == t) / total for t in (1, 2, 3)}
    print(f"{total} prompt tokens; prompt tokens by turn: 1st {share[1]:.2f}, 2nd "
          f"{share[2]:.2f}, 3rd+ {share[3]:.2f}")
    print("| dp | placement | hit rate | hits in turn 1 / 2 / 3+ (share of all prompt tokens) "
          "| one cache / this |")
    print("|---|---|---|---|---|")
    one = replay(reqs, 1, "one cache")
    for dp in dps:
        for policy in POLICIES:
            r = one if policy == "one cache" else replay(reqs, dp, policy)
            by_turn = " / ".join(f"{r[t] / total:.3f}" for t in (1, 2, 3))
            print(f"| {dp} | {policy} | {hit_rate(r, total):.3f} | {by_turn} | "
                  f"{hit_rate(one, total) / hit_rate(r, total):.2f} |")


def by_offset(rows: dict[int, list[Prompt]], dps: list[int]) -> None:
    """One line per sample (conversation ids = offset mod every): one cache vs round robin."""
    print("| offset | requests | one cache | " + " | ".join(
        f"round_robin dp {dp} | one cache / round_robin dp {dp}" for dp in dps) + " |")
    print("|---" * (3 + 2 * len(dps)) + "|")
    for offset, reqs in rows.items():
        total = sum(p.length for p in reqs)
        one = hit_rate(replay(reqs, 1, "one cache"), total)
        cells = [(hit_rate(replay(reqs, dp, "round_robin"), total)) for dp in dps]
        print(f"| {offset} | {len(reqs)} | {one:.3f} | " + " | ".join(
            f"{rr:.3f} | {one / rr:.2f}" for rr in cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sample_args(ap, "0: every sampled request")
    ap.add_argument("--offset", type=int, nargs="+", default=[0],
                    help="conversation ids modulo --every sampled (several: one line each)")
    ap.add_argument("--dp", type=int, nargs="+", default=[2])
    args = ap.parse_args()
    print(f"Mooncake conversation trace, one conversation in {args.every}, first "
          f"{args.requests or 'all'} requests, prompts cut to {args.max_blocks} trace blocks")
    rows = {k: prompts(args.trace, args.requests, args.every, args.max_blocks, k)
            for k in args.offset}
    if len(rows) == 1:
        table(next(iter(rows.values())), args.dp)
    else:
        by_offset(rows, args.dp)


if __name__ == "__main__":
    main()

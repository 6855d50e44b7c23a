"""What routing gains when each instance's prefix cache is bounded (its KV pool), offline.

``prefix_cache_ceiling.py`` bounds the gain with UNBOUNDED caches. A real instance's prefix
cache is its KV pool, smaller than a trace's working set: round robin then keeps the same
prefix blocks on every instance (each holds a copy of what the others hold), while a
cache-aware placement keeps each conversation on one instance. This replays the trace's
``hash_ids`` (no model) against the engine's own :class:`engine.block_pool.BlockPool`, one per
instance, ``blocks`` KV blocks each, under these placements:

- ``one cache``: a single pool of ``dp x blocks`` (the same memory, never duplicated);
- ``round_robin``: the router's :class:`RoundRobin`;
- ``longest prefix``: where the most of the prompt is cached now (ties rotate), load aside;
- ``kv_aware``: the router's :class:`KVAware` cost (``preference_given``) over each pool's
  cached prefix, the view the router's :class:`KVIndex` has once the pools' events arrived,
  and its load (``load_given``: the tokens a placed request computes there);
- ``kv_aware, prompt load`` (``--prompt-load``): the same cost with a placed request's whole
  prompt as its load, as the router counted it until 2026-12-07.

Each request is served as the engine serves it (``Scheduler.allocate`` / ``cache_computed``):
``allocate(blocks_needed(prompt + out_tokens), hashes of its first (prompt - 1) // BLOCK
blocks)`` reuses the cached prefix and evicts least-recently-freed cached blocks for the rest,
every full prompt block is registered, then the set is freed. Assumptions (state them with the
figures): requests are instantaneous, one after the other (no other request's blocks are held
while one allocates, so the whole pool is cache); requests of one trace tick (same timestamp)
are placed together from the state before the tick (as ``prefix_cache_bench.py``'s router
sees it: its events arrive after a tick's first tokens), each placement adding its load to
the instance's outstanding tokens until the tick ends (balance: :class:`Outcome`).
``out_tokens = 1`` is a colocated instance (it reserves its output block; the live
benchmark's); 0 a prefill instance.

Tokens are scaled as the benchmark serves them (``prefix_trace.py``: a trace block =
``TRACE_BLOCK`` tokens = 4 KV blocks of ``BLOCK``), so hit rates compare with the live ones at
the same pool size. Sizes are fractions of the sample's working set (distinct full KV blocks:
an unbounded cache's content at the end) or explicit blocks. Run:
``PYTHONPATH=. python benchmarks/prefix_cache_bounded.py --dp 2 4``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.prefix_trace import (BLOCK, TRACE_BLOCK, add_sample_args, sample_rows,
                                     scaled_length)
from engine.block_pool import BlockPool
from engine.prefix_hash import reusable_blocks
from orchestrator.router.policies import KVAware, RoundRobin

PLACEMENTS = ("round_robin", "longest prefix", "kv_aware")
# NOTE: not the router's: kv_aware whose load is each placed request's whole prompt
PROMPT_LOAD = "kv_aware, prompt load"
FRACTIONS = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 3 / 32, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 1.0)


@dataclass(frozen=True)
class KVPrompt:
    """One scaled request: arrival tick (ms), prompt tokens, the chained keys of its full KV
    blocks (equal key = equal whole prefix, as the engine's block hash)."""

    tick: int
    length: int
    hashes: tuple[int, ...]


def kv_prompts(trace, requests: int, every: int, max_blocks: int,
               offset: int = 0) -> list[KVPrompt]:
    """The benchmark's sample (``prefix_trace.sample_rows``) as :class:`KVPrompt` s. A KV
    block's key is (its trace block's chained key, its index in it): a trace block's tokens
    are a function of its hash id, so equal keys are equal tokens."""
    out = []
    for row in sample_rows(trace, requests, every, offset):
        length, key, hashes = scaled_length(row, max_blocks), 0, []
        for j, h in enumerate(row.hash_ids[:max_blocks]):
            key = hash((key, h))
            full = min(TRACE_BLOCK, length - j * TRACE_BLOCK) // BLOCK
            hashes += [hash((key, b)) for b in range(max(full, 0))]
        out.append(KVPrompt(round(row.arrival_s * 1000), length, tuple(hashes)))
    return out


def working_set(reqs: list[KVPrompt]) -> int:
    """Distinct full KV blocks of the sample (what an unbounded cache ends up holding)."""
    return len({h for p in reqs for h in p.hashes})


def min_blocks(reqs: list[KVPrompt], out_tokens: int) -> int:
    """The smallest pool that admits every request alone."""
    return max(-(-(p.length + out_tokens) // BLOCK) for p in reqs)


def serve(pool: BlockPool, p: KVPrompt, out_tokens: int) -> int:
    """Serve ``p`` on ``pool`` as the engine does (module docstring); its cached tokens."""
    limit = reusable_blocks(p.length, BLOCK)
    blocks = pool.allocate(pool.blocks_needed(p.length + out_tokens), p.hashes[:limit])
    pool.cache_blocks(blocks, blocks.num_cached, p.hashes[blocks.num_cached:])
    pool.free(blocks)
    return blocks.num_cached * BLOCK


def ticks(reqs: list[KVPrompt]) -> list[list[KVPrompt]]:
    """Consecutive requests of one arrival tick, grouped."""
    out: list[list[KVPrompt]] = []
    for p in reqs:
        if out and out[-1][0].tick == p.tick:
            out[-1].append(p)
        else:
            out.append([p])
    return out


@dataclass(frozen=True)
class Outcome:
    """One replay's figures. Computed tokens are a prompt's tokens less what its instance
    held (as served).

    hit_rate: cached prompt tokens / prompt tokens.
    tick_imbalance: sum over ticks of the busiest instance's computed tokens / sum over ticks
        of the mean instance's: 1.0 when every tick's prefill work is split evenly, ``dp`` when
        one instance computes everything; with instances computing at the same rate, a tick's
        prefill time relative to an even split (a tick of one request is ``dp`` under any
        placement, so round robin's figure is the reference, not 1.0).
    run_imbalance: the busiest instance's computed tokens over the whole replay / the mean
        instance's.
    """

    hit_rate: float
    tick_imbalance: float
    run_imbalance: float


def replay(reqs: list[KVPrompt], dp: int, placement: str, blocks: int,
           out_tokens: int = 1, overlap_weight: float = 1.0) -> Outcome:
    """``placement`` over ``dp`` pools of ``blocks`` blocks (``one cache``: one pool of
    ``dp x blocks``), requests of a tick placed from the state before it (``overlap_weight``:
    :class:`KVAware`'s, for the ``kv_aware`` placements).

    Raises:
        ValueError: ``blocks`` below :func:`min_blocks`, or an unknown placement.
    """
    if placement == "one cache":
        blocks, dp = blocks * dp, 1
    elif placement not in (*PLACEMENTS, PROMPT_LOAD):
        raise ValueError(f"unknown placement {placement!r}: use one of "
                         f"{['one cache', *PLACEMENTS, PROMPT_LOAD]}")
    if blocks < min_blocks(reqs, out_tokens):
        raise ValueError(f"{blocks} blocks cannot admit the longest request")
    names = [f"i{k}" for k in range(dp)]
    pools = [BlockPool(blocks, BLOCK, salt=1) for _ in names]
    policy = KVAware(names, overlap_weight=overlap_weight) \
        if placement.startswith("kv_aware") else RoundRobin(names)
    hits, n, busiest, run = 0, 0, 0, [0] * dp
    for tick in ticks(reqs):
        chosen = []
        for p in tick:
            chosen.append(place(p, pools, policy, placement, n))
            policy.acquire(names[chosen[-1][0]], chosen[-1][1])
            n += 1
        computed = [0] * dp
        for p, (k, load) in zip(tick, chosen):
            cached = serve(pools[k], p, out_tokens)
            hits += cached
            computed[k] += p.length - cached
            policy.release(names[k], load)
        busiest += max(computed)
        run = [a + b for a, b in zip(run, computed)]
    total = sum(p.length for p in reqs)
    mean = max(sum(run) / dp, 1e-9)
    return Outcome(hits / total, busiest / mean, max(run) / mean)


def place(p: KVPrompt, pools: list[BlockPool], policy: KVAware | RoundRobin, placement: str,
          n: int) -> tuple[int, int]:
    """(index of the pool ``placement`` chooses for ``p``, the load it charges there) from the
    pools' state now; ``n``: requests placed before (``longest prefix`` rotates its ties)."""
    dp = len(pools)
    # NOTE: the router's view (KVIndex): only the blocks an admission may reuse
    cached = [pool.cached_prefix(p.hashes[:reusable_blocks(p.length, BLOCK)]) * BLOCK
              for pool in pools]
    if placement == "longest prefix":
        k = max(range(dp), key=lambda j: (cached[j], -((j - n) % dp)))
    elif isinstance(policy, KVAware):
        k = policy.instances.index(
            policy.preference_given(dict(zip(policy.instances, cached)), p.length)[0])
    else:
        k = policy.instances.index(policy.preference()[0])
    if placement == "kv_aware":
        return k, policy.load_given(cached[k], p.length)
    return k, p.length


def sizes(reqs: list[KVPrompt], fractions: list[float], explicit: list[int],
          out_tokens: int) -> list[int]:
    """Pool sizes (blocks per instance): each fraction of the working set (at least
    :func:`min_blocks`), the explicit ones, and 'unbounded' (working set + one request)."""
    ws, floor = working_set(reqs), min_blocks(reqs, out_tokens)
    out = {max(floor, round(f * ws)) for f in fractions} | {max(floor, b) for b in explicit}
    return sorted(out | {ws + floor})


def curve(reqs: list[KVPrompt], dp: int, blocks: list[int], out_tokens: int,
          prompt_load: bool = False, overlap_weight: float = 1.0) -> None:
    """Two tables, one row per pool size: every placement's hit rate and the ratios to round
    robin; then each placement's tick / run imbalance (:class:`Outcome`) (``prompt_load``:
    also :data:`PROMPT_LOAD`'s)."""
    ws = working_set(reqs)
    placed = [*PLACEMENTS, *([PROMPT_LOAD] if prompt_load else [])]
    rows = {b: {pl: replay(reqs, dp, pl, b, out_tokens, overlap_weight)
                for pl in ("one cache", *placed)} for b in blocks}
    print(f"\ndp {dp} (blocks per instance; working set {ws} blocks): hit rates")
    print("| blocks / instance | of working set | one cache of dp x blocks |" +
          "".join(f" {pl} |" for pl in placed) +
          "".join(f" {pl} / round_robin |" for pl in placed[1:]))
    print("|---" * (2 + 2 * len(placed)) + "|")
    for b, r in rows.items():
        label = "unbounded" if b >= ws + min_blocks(reqs, out_tokens) else f"{b / ws:.3f}"
        rr = max(r["round_robin"].hit_rate, 1e-9)
        print(f"| {b} | {label} | {r['one cache'].hit_rate:.3f} |" +
              "".join(f" {r[pl].hit_rate:.3f} |" for pl in placed) +
              "".join(f" {r[pl].hit_rate / rr:.2f} |" for pl in placed[1:]))
    print(f"\ndp {dp}: tick imbalance / run imbalance (computed tokens, busiest / mean)")
    print("| blocks / instance |" + "".join(f" {pl} |" for pl in placed))
    print("|---" * (1 + len(placed)) + "|")
    for b, r in rows.items():
        print(f"| {b} |" + "".join(f" {r[pl].tick_imbalance:.2f} / {r[pl].run_imbalance:.3f} |"
                                   for pl in placed), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_sample_args(ap, "0: every sampled request")
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--fractions", type=float, nargs="*", default=list(FRACTIONS),
                    help="pool sizes as fractions of the working set")
    ap.add_argument("--blocks", type=int, nargs="*", default=[],
                    help="pool sizes in KV blocks (e.g. the live benchmark's --kv-blocks)")
    ap.add_argument("--out-tokens", type=int, default=1,
                    help="1: colocated instances (the live benchmark's); 0: prefill")
    ap.add_argument("--overlap-weight", type=float, default=1.0,
                    help="kv_aware's overlap_weight (the router's: 1.0)")
    ap.add_argument("--prompt-load", action="store_true",
                    help=f"also {PROMPT_LOAD!r} (the router's load until 2026-12-07)")
    ap.add_argument("--one-per-tick", action="store_true",
                    help="each request its own tick (no two placed from the same state)")
    args = ap.parse_args()
    reqs = kv_prompts(args.trace, args.requests, args.every, args.max_blocks, args.offset)
    if args.one_per_tick:
        reqs = [KVPrompt(i, p.length, p.hashes) for i, p in enumerate(reqs)]
    print(f"Mooncake conversation trace, one conversation in {args.every} (offset "
          f"{args.offset}), {len(reqs)} requests, prompts cut to {args.max_blocks} trace "
          f"blocks, {sum(p.length for p in reqs)} prompt tokens, {len(ticks(reqs))} ticks")
    blocks = sizes(reqs, args.fractions, args.blocks, args.out_tokens)
    for dp in args.dp:
        curve(reqs, dp, blocks, args.out_tokens, args.prompt_load, args.overlap_weight)


if __name__ == "__main__":
    main()

"""Prefix cache benchmark on the Mooncake conversation trace (CPU, tiny model, ranks in-process).

The trace (``../shared/data/mooncake_conversation_trace.jsonl``, Kimi, Apache-2.0) gives each
request its 512-token prefix blocks as ``hash_ids`` (equal leading ids = shared prefix). Scaled
to the tiny model: one trace block -> ``TRACE_BLOCK`` = 64 tokens (lengths / 8; 4 KV blocks of
``BLOCK`` = 16), the block's token ids drawn from a generator seeded by its hash id, so shared
blocks are shared tokens and the prefix structure is preserved exactly. Prompts longer than
``--max-blocks`` trace blocks are cut (the report says how many). Each request asks for one token (TTFT is what the
cache changes; decode is unchanged).

Runs, all in one process and session (ratios against the cache-off run of the same requests):

1. one instance, cache off vs on (pool large enough for the working set): token hit rate vs
   the trace's ideal (every repeated leading block hit, the last prompt token always
   computed), TTFT p50 / mean;
2. two instances (prefill dp 2), cache on: ``round_robin`` vs ``kv_aware`` (the router's
   policy object and KV index, fed by the instances' KV events): hit rate and TTFT
   (1 and 2 run interleaved tick by tick, all instances alive at once: ratios in one window);
3. multi-turn PD (prefill + decode ranks): conversations of ``--turns`` turns, each turn =
   previous turn's prompt + its output + new user tokens; KV bytes prefill ships per request
   with the decode side's cache off vs on.

The trace is sampled by conversation (``--every``: one conversation in N, over a longer
stretch of the trace, so a conversation's later turns are in the sample as in the full trace:
reuse comes from them). Requests of one trace tick (same timestamp) are submitted together; ticks run one after
another (the time between ticks is not replayed). Not a test; run:
``PYTHONPATH=. python benchmarks/prefix_cache_bench.py`` (docs/prefix_cache.md has the table).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from decode_worker.role import DecodeRole
from engine.prefix_hash import block_hashes
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.bench.traces import read_mooncake
from orchestrator.router.kv_index import KVIndex
from orchestrator.router.policies import make_policy
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.colocated import ColocatedRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Abort, Admit, Generate, Prefill, Reserve
from rank.rank import Rank

BLOCK = 16
TRACE_BLOCK = 64
ROOT = Path(__file__).resolve().parents[1]
# NOTE: the nearest shared/data beside the repository or above it (a worktree sits deeper)
TRACES = [p / "shared" / "data" / "mooncake_conversation_trace.jsonl"
          for p in list(ROOT.parents)[:3]]
VOCAB = 129280


@dataclass(frozen=True)
class TraceRequest:
    """One scaled trace request: arrival tick (ms), prompt token ids, trace prefix blocks."""

    tick: int
    prompt: tuple[int, ...]
    hash_ids: tuple[int, ...]


def block_tokens(hash_id: int) -> list[int]:
    """The ``TRACE_BLOCK`` token ids standing for trace block ``hash_id``."""
    gen = torch.Generator().manual_seed(hash_id)
    return torch.randint(2, VOCAB, (TRACE_BLOCK,), generator=gen).tolist()


def load_trace(path: Path, n: int, max_blocks: int,
               every: int) -> tuple[list[TraceRequest], int]:
    """The first ``n`` requests of one conversation in ``every`` (a request's conversation:
    its second prefix block, the first after the shared system prompt), scaled; and how many
    were cut to ``max_blocks`` blocks."""
    out, cut = [], 0
    for row in read_mooncake(path):
        if len(out) == n:
            break
        if row.hash_ids[min(1, len(row.hash_ids) - 1)] % every:
            continue
        length = max(1, -(-row.input_len * TRACE_BLOCK // 512))
        ids = row.hash_ids[:max_blocks]
        if length > max_blocks * TRACE_BLOCK:
            cut, length = cut + 1, max_blocks * TRACE_BLOCK
        tokens = [t for h in ids for t in block_tokens(h)][:length]
        out.append(TraceRequest(round(row.arrival_s * 1000), tuple(tokens), tuple(ids)))
    return out, cut


def ideal_hit_rate(reqs: list[TraceRequest]) -> tuple[float, int]:
    """Prompt tokens an unbounded cache would hit / all prompt tokens (the leading full KV
    blocks seen before, at most ``(prompt - 1) // BLOCK``: the last token is always computed),
    and the distinct full blocks (the working set)."""
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        hashes = block_hashes(r.prompt, BLOCK)
        n = 0
        while n < (len(r.prompt) - 1) // BLOCK and hashes[n] in seen:
            n += 1
        hit, total = hit + n * BLOCK, total + len(r.prompt)
        seen.update(hashes)
    return hit / total, len(seen)


def start(ckpt: Path, role_cls, name: str, role: str, blocks: int, cache: bool) -> Rank:
    """One TP=1 rank (its own loop thread) of ``role``."""
    sched = SchedulerConfig(block_size=BLOCK, num_kv_blocks=blocks, chunk_size=2048,
                            max_num_batched_tokens=2048, max_num_seqs=16, prefix_cache=cache)
    cfg = InstanceConfig(name=name, role=role, checkpoint_dir=str(ckpt), scheduler=sched)
    rank = Rank(cfg, 0, role_cls)
    rank.start_alone()
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
            self.policy.acquire(name, len(r.prompt))
            placed.append((name, len(r.prompt)))
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


def replay(ckpt: Path, reqs: list[TraceRequest], blocks: int) -> dict[str, dict]:
    """Every configuration over the same requests, INTERLEAVED tick by tick (each tick runs
    on one configuration after the other), so a change of machine load hits all alike."""
    def ranks(prefix: str, n: int, cache: bool) -> list[Rank]:
        return [start(ckpt, ColocatedRole, f"{prefix}-{i}", "colocated", blocks, cache)
                for i in range(n)]

    setups = {"1 instance, cache off": Setup(ranks("off", 1, False), "round_robin"),
              "1 instance, cache on": Setup(ranks("on", 1, True), "round_robin"),
              "dp 2, round_robin": Setup(ranks("rr", 2, True), "round_robin"),
              "dp 2, kv_aware": Setup(ranks("kv", 2, True), "kv_aware")}
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
    ap.add_argument("--trace", type=Path,
                    default=next((p for p in TRACES if p.is_file()), TRACES[0]))
    ap.add_argument("--requests", type=int, default=260)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--max-blocks", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    reqs, cut = load_trace(args.trace, args.requests, args.max_blocks, args.every)
    ideal, distinct = ideal_hit_rate(reqs)
    # NOTE: holds the working set (every distinct block) plus one tick's requests in flight
    blocks = distinct + 8 * (args.max_blocks * TRACE_BLOCK // BLOCK + 1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        runs = replay(ckpt, reqs, blocks)
        turns = multiturn(ckpt, reqs[:args.conversations], args.turns, out_len=8)
    print(f"{len(reqs)} Mooncake conversation requests (one conversation in {args.every}; "
          f"{cut} cut to {args.max_blocks} blocks), prompt tokens {sum(len(r.prompt) for r in reqs)}, ideal hit rate "
          f"{ideal:.3f}")
    print("| run | hit rate | of ideal | TTFT p50 ms | TTFT mean ms | TTFT p50 ratio |")
    print("|---|---|---|---|---|---|")
    base = runs["1 instance, cache off"]["ttft_p50"]
    for name, r in runs.items():
        print(f"| {name} | {r['hit']:.3f} | {r['hit'] / ideal:.2f} | {1e3 * r['ttft_p50']:.1f} "
              f"| {1e3 * r['ttft_mean']:.1f} | {r['ttft_p50'] / base:.2f} |")
    rr, kv = runs["dp 2, round_robin"], runs["dp 2, kv_aware"]
    print(f"\nkv_aware / round_robin hit rate: {kv['hit'] / max(rr['hit'], 1e-9):.2f}x; TTFT "
          f"p50 {kv['ttft_p50'] / rr['ttft_p50']:.2f}x, mean "
          f"{kv['ttft_mean'] / rr['ttft_mean']:.2f}x")
    print(f"\nmulti-turn PD ({args.conversations} conversations x {args.turns} turns): KV bytes "
          f"shipped per request: decode cache off {turns[False]:.0f}, on {turns[True]:.0f} "
          f"({turns[True] / turns[False]:.2f}x)")


if __name__ == "__main__":
    main()

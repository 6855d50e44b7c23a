"""The Mooncake conversation trace, sampled and scaled for the prefix-cache benchmarks.

The trace (``../shared/data/mooncake_conversation_trace.jsonl``, Kimi, Apache-2.0) gives each
request its 512-token prefix blocks as ``hash_ids`` (equal leading ids = shared prefix). Scaled
to the tiny model: one trace block -> ``TRACE_BLOCK`` = 64 tokens (lengths / 8; 4 KV blocks of
``BLOCK`` = 16), the block's token ids drawn from a generator seeded by its hash id, so shared
blocks are shared tokens and the prefix structure is preserved exactly. Prompts longer than
``max_blocks`` trace blocks are cut.

The trace is sampled by conversation (``every``: one conversation in N, a conversation being
a request's second prefix block, the first after the system prompt every request shares), so
a sampled conversation keeps all its turns, as in the full trace: reuse comes from them.
Used by ``prefix_cache_bench.py``, ``prefix_cache_load.py`` and ``prefix_cache_ceiling.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.prefix_hash import block_hashes
from orchestrator.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceEntry, read_mooncake
from rank.config import InstanceConfig, SchedulerConfig
from rank.rank import Rank

BLOCK = 16
TRACE_BLOCK = 64
ROOT = Path(__file__).resolve().parents[1]
# NOTE: the nearest shared/data beside the repository or above it (a worktree sits deeper)
TRACES = [p / "shared" / "data" / "mooncake_conversation_trace.jsonl"
          for p in list(ROOT.parents)[:3]]
DEFAULT_TRACE = next((p for p in TRACES if p.is_file()), TRACES[0])
VOCAB = 129280


@dataclass(frozen=True)
class TraceRequest:
    """One scaled trace request: arrival tick (ms), prompt token ids, trace prefix blocks."""

    tick: int
    prompt: tuple[int, ...]
    hash_ids: tuple[int, ...]


def add_sample_args(ap, requests_help: str | None = None) -> None:
    """The trace-sample options every prefix-cache benchmark takes: ``--trace``, ``--requests``,
    ``--every`` (one conversation in N), ``--max-blocks`` (trace blocks a prompt is cut to)."""
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=260, help=requests_help)
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--max-blocks", type=int, default=16)


def block_tokens(hash_id: int) -> list[int]:
    """The ``TRACE_BLOCK`` token ids standing for trace block ``hash_id``."""
    gen = torch.Generator().manual_seed(hash_id)
    return torch.randint(2, VOCAB, (TRACE_BLOCK,), generator=gen).tolist()


def sample_rows(path: Path, n: int, every: int, offset: int = 0) -> list[TraceEntry]:
    """The first ``n`` trace rows (all when ``n`` is 0) of one conversation in ``every``
    (those whose conversation id is ``offset`` modulo ``every``)."""
    out = []
    for row in read_mooncake(path):
        if n and len(out) == n:
            break
        if row.hash_ids[min(1, len(row.hash_ids) - 1)] % every == offset:
            out.append(row)
    return out


def scaled_length(row: TraceEntry, max_blocks: int) -> int:
    """Prompt tokens of ``row`` scaled to ``TRACE_BLOCK`` tokens a trace block, cut to
    ``max_blocks`` trace blocks."""
    length = max(1, -(-row.input_len * TRACE_BLOCK // MOONCAKE_BLOCK_TOKENS))
    return min(length, max_blocks * TRACE_BLOCK)


def load_trace(path: Path, n: int, max_blocks: int,
               every: int) -> tuple[list[TraceRequest], int]:
    """The sample of :func:`sample_rows`, scaled (token ids of every block); and how many
    prompts were cut to ``max_blocks`` blocks."""
    out, cut = [], 0
    for row in sample_rows(path, n, every):
        length = scaled_length(row, max_blocks)
        cut += length < -(-row.input_len * TRACE_BLOCK // MOONCAKE_BLOCK_TOKENS)
        ids = row.hash_ids[:max_blocks]
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

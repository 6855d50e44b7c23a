"""Replay a workload against a running router over gRPC, or against any OpenAI-compatible
server (``backend="openai"``), and time every token.

Each timed request sleeps until its arrival time, waits for a concurrency slot
(``max_concurrency``), sends (greedy, ``ignore_eos``, ``max_tokens = output_len``) and stamps
every streamed message with ``time.perf_counter()``; warm-up requests go first, one at a time.
Every wait is bounded (``connect_timeout_s``, ``request_timeout_s`` plus an asyncio backstop),
so the run ends by itself.
"""

from __future__ import annotations

import asyncio
import secrets
import time

from orchestrator.bench.grpc_backend import grpc_sender
from orchestrator.bench.openai_backend import openai_sender
from orchestrator.bench.records import RequestRecord, RunnerConfig, RunResult, Send
from orchestrator.bench.workloads import BenchRequest, Workload

# NOTE: RunnerConfig.backend -> a context manager yielding a connected Send.
BACKENDS = {"grpc": grpc_sender, "openai": openai_sender}


async def _timed(send: Send, req: BenchRequest, t0: float, run_id: str,
                 sem: asyncio.Semaphore | None, bar) -> RequestRecord:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    if sem is None:
        rec = await send(req, t0, run_id)
    else:
        async with sem:
            rec = await send(req, t0, run_id)
    bar.update(1)
    return rec


class _NoBar:
    """Stands in for tqdm when there is no progress bar (tqdm starts a monitor thread even
    when disabled)."""

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def update(self, n: int) -> None:
        return None


def _progress_bar(total: int, cfg: RunnerConfig):
    if not cfg.progress:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="req", desc=cfg.label)


async def run_benchmark(workload: Workload, cfg: RunnerConfig) -> RunResult:
    """Send the warm-up requests one by one, then replay the timed ones on schedule.

    Raises:
        ConnectionError: the server is not reachable within ``cfg.connect_timeout_s``.
    """
    run_id = secrets.token_hex(3)
    async with BACKENDS[cfg.backend](cfg) as send:
        warm = [await send(r, time.perf_counter(), run_id) for r in workload.warmup]
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        with _progress_bar(len(workload.requests), cfg) as bar:
            started_at, t0 = time.time(), time.perf_counter()
            timed = await asyncio.gather(*(
                _timed(send, r, t0, run_id, sem, bar) for r in workload.requests))
            duration = time.perf_counter() - t0
    return RunResult(records=tuple(warm) + tuple(timed), duration_s=duration,
                     started_at=started_at)

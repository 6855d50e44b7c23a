"""Abort storm against real ranks (tiny model, prefill tp1 + decode tp1 on the session Ray,
the router and its gRPC server in this process): 100 requests, each aborted by RPC at a
seeded random moment in its first 2 s, whatever it is doing then (tokenizing, waiting for KV
blocks, reserving, prefilling, decoding). Every one ends `abort` (none runs to `length`) and
afterwards every KV block is free on both instances."""

from __future__ import annotations

import asyncio
import random
import time

import grpc

from orchestrator.deploy.assemble import build_board, build_monitor, build_router
from orchestrator.config.checkpoint import ensure_checkpoint, read_model_info
from orchestrator.api.client import AsyncOrchClient
from orchestrator.deploy.cluster import bring_up
from orchestrator.config.schema import OrchConfig
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.api.server import OrchServer
from tests.leaks import busy_instances

SEED = 10
N = 100
WINDOW_S = 2.0  # requests start over this window; each is aborted this long after at most
MAX_TOKENS = 1900  # NOTE: far more than 2 s of decode steps: only the abort can end them
FREE_WITHIN_S = 30.0


def _cfg() -> OrchConfig:
    return OrchConfig.model_validate({
        "model": {"max_model_len": 2048},
        "cluster": {"device": "cpu", "cpus_per_rank": 0.1, "startup_timeout_s": 180,
                    "bind_host": "127.0.0.1"},
        "prefill": {"tp": 1, "num_kv_blocks": 256, "chunk_size": 32,
                    "max_num_batched_tokens": 128, "max_num_seqs": 8},
        "decode": {"tp": 1, "num_kv_blocks": 1024, "max_num_seqs": 8},
        "kv_transfer": {"backend": "gloo"},
        "router": {"request_timeout_s": 60, "max_pending": N}})


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(["abort", "storm", "token", "decode", "prefill", "block"])
                    for _ in range(rng.randint(3, 40)))


async def _one(client: AsyncOrchClient, rid: str, prompt: str, start_s: float,
               abort_after_s: float) -> tuple[bool, list, str]:
    """Start one request at ``start_s``, abort it ``abort_after_s`` later; (found, chunks,
    how it ended: the last finish_reason or the gRPC status name)."""
    await asyncio.sleep(start_s)
    chunks: list = []
    ending: list[str] = []

    async def consume() -> None:
        try:
            async for chunk in client.generate(prompt, request_id=rid, max_tokens=MAX_TOKENS,
                                               ignore_eos=True, timeout_s=120):
                chunks.append(chunk)
        except grpc.aio.AioRpcError as err:
            ending.append(err.code().name)
        else:
            ending.append(str(chunks[-1].finish_reason))

    stream = asyncio.create_task(consume())
    await asyncio.sleep(abort_after_s)  # NOTE: the storm's schedule, not a synchronisation
    deadline = time.monotonic() + 5.0
    found = await client.abort(rid)
    # NOTE: an Abort sent a few ms after its Generate may overtake it on the wire; the
    # router cannot know an id it has not received yet, so that Abort is sent again.
    while not found and not stream.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        found = await client.abort(rid)
    await asyncio.wait_for(stream, 60)
    return found, chunks, ending[0]


async def _all_free(router) -> list:
    """Leader statuses once every block is free and nothing runs (bounded)."""
    deadline = time.monotonic() + FREE_WITHIN_S
    while True:
        statuses = await asyncio.gather(*(l.status() for l in router.flow.leaders))
        if not busy_instances(statuses) or time.monotonic() > deadline:
            return statuses
        await asyncio.sleep(0.2)


async def _storm(cfg: OrchConfig, leaders: dict, model, tokenizer):
    router = build_router(cfg, leaders, model, tokenizer)
    monitor = build_monitor(cfg, lambda name: [leaders[name]])
    server = OrchServer(router, build_board(cfg, router, monitor), "127.0.0.1", 0)
    client = AsyncOrchClient(f"127.0.0.1:{await server.start()}")
    try:
        rng = random.Random(SEED)
        plans = [(f"storm-{i}", _prompt(rng), i * WINDOW_S / N, rng.uniform(0.0, WINDOW_S))
                 for i in range(N)]
        results = await asyncio.gather(*(_one(client, *plan) for plan in plans))
        statuses = await _all_free(router)
        loads = {**router.flow.policy.outstanding, **router.flow.prefill_policy.outstanding}
        return results, statuses, loads, router.in_flight
    finally:
        await client.close()
        await server.stop(grace_s=5.0)


def test_abort_storm_every_request_ends_abort_and_every_block_is_free(ray_session):
    cfg = _cfg()
    checkpoint = ensure_checkpoint(cfg.model)
    model = read_model_info(checkpoint, cfg.model.path, cfg.model.max_model_len)
    tokenizer = Tokenizer(checkpoint) if (checkpoint / "tokenizer.json").is_file() else None
    cluster = bring_up(cfg)
    try:
        results, statuses, loads, in_flight = asyncio.run(
            _storm(cfg, cluster.leaders(), model, tokenizer))
    finally:
        cluster.teardown()
    not_found = [i for i, (found, _, _) in enumerate(results) if not found]
    assert not_found == [], f"Abort found nothing for storm-{not_found}"
    endings = [ending for _, _, ending in results]
    assert endings == ["abort"] * N, {e: endings.count(e) for e in set(endings)}
    assert max(c[-1].stats.completion_tokens for _, c, _ in results) < MAX_TOKENS
    assert [(s.name, s.free_blocks, s.running, s.queue_depth) for s in statuses] == [
        ("prefill-0", 256, 0, 0), ("decode-0", 1024, 0, 0)]
    assert set(loads.values()) == {0} and in_flight == 0

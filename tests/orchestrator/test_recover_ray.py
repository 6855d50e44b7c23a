"""Automatic recovery on the session Ray with the real rank actors and a tiny model: a decode
rank process is killed (SIGKILL), ``Recoverer.recover`` brings the instance back (new actors,
new TP group, new KV addresses) within 60 s, and a disaggregated request through it gives
the same greedy tokens as before the kill (the prefill rank remade its pairs). Then the
prefill rank hangs (SIGSTOP): its recovery kills the stopped process and the decode ranks
pair with the new prefill rank (new pair generations); same tokens again."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from engine.sampling_params import SamplingParams
from orchestrator.deploy.assemble import build_router
from orchestrator.config.checkpoint import read_model_info
from orchestrator.deploy.cluster import bring_up
from orchestrator.config.schema import OrchConfig
from orchestrator.deploy.recovery import Recoverer
from orchestrator.router.request import GenerateInput
from orchestrator.tiny_model import write_tiny_checkpoint

PROMPT = (5, 17, 3, 99, 42, 7, 8, 61, 23, 11, 2, 70, 31, 4, 9, 13, 50)
RECOVER_WITHIN_S = 60.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=3)


def _cfg(ckpt) -> OrchConfig:
    return OrchConfig.model_validate({
        "model": {"path": str(ckpt), "dtype": "float32", "max_model_len": 128},
        "prefill": {"tp": 1, "num_kv_blocks": 16, "chunk_size": 8,
                    "max_num_batched_tokens": 16},
        "decode": {"tp": 2, "num_kv_blocks": 16},
        "kv_transfer": {"block_size": 16, "connect_timeout_s": 10, "payload_timeout_s": 10,
                        "completion_timeout_s": 30},
        "cluster": {"device": "cpu", "cpus_per_rank": 0.1, "startup_timeout_s": 120,
                    "bind_host": "127.0.0.1"},
        "router": {"request_timeout_s": 60}})


async def _rank_pids(cluster, name: str) -> list[int]:
    """Process ids of instance ``name``'s ranks, rank order."""
    infos = await asyncio.gather(*(r.process_info.remote() for r in cluster.ranks_of(name)))
    return [info[2] for info in infos]


def _wait_gone(pid: int, timeout_s: float = 20.0) -> None:
    """Wait until ``pid`` exited (gone, or a zombie awaiting its parent)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"rank process {pid} still runs {timeout_s} s after its restart")


async def _generate(router) -> list[int]:
    inp = GenerateInput(None, PROMPT, SamplingParams(max_tokens=6))
    chunks = [c async for c in router.generate(inp)]
    assert chunks[-1].finish_reason == "length", chunks[-1]
    return [t for c in chunks for t in c.token_ids]


def test_killed_decode_rank_is_recovered_and_serves_the_same_tokens(ray_session, ckpt):
    torch.set_num_threads(1)
    cfg = _cfg(ckpt)
    cluster = bring_up(cfg)
    old_ranks = cluster.ranks_of("decode-0")
    try:
        async def scenario() -> tuple[list[int], list[list[int]], list[float]]:
            router = build_router(cfg, cluster.leaders(), read_model_info(ckpt, "tiny", 128),
                                  None)
            router.start()
            leaders = {leader.name: leader for leader in router.flow.leaders}
            recoverer = Recoverer(cluster, leaders, timeout_s=RECOVER_WITHIN_S)
            after, took = [], []
            try:
                before = await _generate(router)
                for tp, name, sig in ((2, "decode-0", signal.SIGKILL),
                                      (1, "prefill-0", signal.SIGSTOP)):
                    pids = await _rank_pids(cluster, name)
                    assert len(pids) == tp, pids
                    os.kill(pids[-1], sig)
                    t0 = time.monotonic()
                    assert await recoverer.recover(name)
                    took.append(time.monotonic() - t0)
                    _wait_gone(pids[-1])  # NOTE: a stopped process is killed too
                    after.append(await _generate(router))
                return before, after, took
            finally:
                await router.stop(drain_timeout_s=5)

        before, after, took = asyncio.run(scenario())
        assert max(took) < RECOVER_WITHIN_S, took
        assert after == [before, before]
        new_ranks = cluster.ranks_of("decode-0")
        assert len(new_ranks) == 2 and not set(new_ranks) & set(old_ranks)
        assert cluster.leaders()["decode-0"] == new_ranks[0]
    finally:
        cluster.teardown()
    live = [pg["name"] for pg in ray_session.util.placement_group_table().values()
            if pg["state"] != "REMOVED" and pg["name"].startswith("orch-")]
    assert live == []

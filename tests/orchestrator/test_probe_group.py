"""The health probe has a thread of its own on every rank actor: while every call thread
waits for the step lock (a long step: a graph capture on first use), a ping still answers
at once, so a busy rank is not taken for a hung one."""

from __future__ import annotations

import asyncio
import threading
import time

from orchestrator.deploy import health
from orchestrator.deploy.rank_actors import ACTOR_CONCURRENCY, rank_actor


class BusyRank:
    """A rank look-alike: ``locked`` waits for the lock a long step holds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # the step holds it

    def locked(self) -> None:
        self._lock.acquire(timeout=20)

    def node_info(self) -> tuple[str, str]:
        return "node-a", "cpu"


def test_a_ping_answers_while_every_call_thread_waits_for_the_step_lock(ray_session):
    ray = ray_session
    rank = rank_actor(BusyRank).options(num_cpus=0.1).remote()
    ray.get(rank.node_info.remote(), timeout=60)
    waiting = [rank.locked.remote() for _ in range(ACTOR_CONCURRENCY + 4)]
    time.sleep(0.5)  # NOTE: let the calls take every call thread (no event crosses Ray)

    async def ping() -> tuple[str, str]:
        return await asyncio.wait_for(health._ping(rank), 3.0)

    try:
        assert asyncio.run(ping()) == ("node-a", "cpu")
    finally:
        ray.kill(rank)
        del waiting

"""The leak checks tests end with (vLLM's ``assert_scheduler_empty``): every KV block free
exactly once, nothing queued or running, no KV pair or connector thread left, no other thread
the project names still alive.

What is checked where:
- a :class:`engine.block_pool.BlockPool`: free blocks == total and no block set live;
- a :class:`engine.scheduler.Scheduler`: its pool, and no request waiting or running;
- a leader rank in-process (``.pool``, ``.num_active()``): its pool and no active request;
- an instance seen through ``status()`` (:class:`rank.messages.InstanceStatusInfo`, over Ray or
  gRPC): all blocks free (DeepSeek-V4: every KV group pool's too), nothing queued or running;
- threads: KV transfer threads are named ``kv-...`` (pair senders and receivers, the
  rendezvous acceptor, connectors); rank threads ``<instance>-loop`` and ``<...>-steps``.

With the prefix cache, free blocks include cached ones nobody references: "all free" also
means every block's reference count is back at zero.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

KV_THREAD = re.compile(r"kv-")
PROJECT_THREAD = re.compile(r"kv-|.+-loop$|.+-steps$|calib-router$")


def assert_pool_empty(pool: Any) -> None:
    """Every block of ``pool`` (a BlockPool) is free and no block set is live."""
    free, total, live = pool.num_free_blocks, pool.num_blocks, pool.num_live_sets
    assert (free, live) == (total, 0), \
        f"KV blocks leak: {free} of {total} blocks free, {live} block set(s) still live"
    refs = getattr(pool, "num_referenced_blocks", 0)
    assert refs == 0, f"KV blocks leak: {refs} block(s) still referenced"


def assert_scheduler_empty(scheduler: Any) -> None:
    """Nothing waits or runs on ``scheduler`` and its pool is empty."""
    waiting = [r.request_id for r in scheduler.waiting]
    running = [r.request_id for r in scheduler.running]
    assert not waiting and not running, f"requests left: waiting {waiting}, running {running}"
    assert_pool_empty(scheduler.pool)


def rank_busy(rank: Any) -> str | None:
    """Why an in-process leader rank (a :class:`rank.rank.Rank`: ``.leader.pool`` and
    ``.role.num_active()``) is not idle (blocks held or referenced, requests active), or None."""
    pool = rank.leader.pool
    free, total, live = pool.num_free_blocks, pool.num_blocks, pool.num_live_sets
    refs, active = pool.num_referenced_blocks, rank.role.num_active()
    if (free, live, refs, active) == (total, 0, 0, 0):
        return None
    return (f"{rank.cfg.name}: {free} of {total} blocks free, {live} block set(s) live, "
            f"{refs} block(s) referenced, {active} request(s) active")


def wait_ranks_idle(*ranks: Any, timeout_s: float = 10.0) -> None:
    """Wait until every in-process leader rank is idle (see :func:`rank_busy`).

    Raises:
        AssertionError: some rank is still busy after ``timeout_s`` (names them and why).
    """
    _wait(lambda: [why for r in ranks if (why := rank_busy(r))], timeout_s, "ranks not idle")


def busy_instances(statuses: Iterable[Any]) -> list[Any]:
    """The instance statuses (``InstanceStatusInfo`` or its GetStatus proto) with blocks in
    use (DeepSeek-V4: in a KV group pool too) or work queued or running; empty when every
    instance is idle."""
    return [s for s in statuses if s.free_blocks != s.total_blocks or s.queue_depth
            or s.running or _groups_held(s)]


def _groups_held(status: Any) -> dict[str, int]:
    """KV group -> blocks in use of a DeepSeek-V4 instance's status (tuples, or the proto's
    ``KVGroupBlocks``); only groups with blocks in use."""
    held = {}
    for g in getattr(status, "kv_groups", ()):
        name, free, total = (g.group, g.free_blocks, g.total_blocks) \
            if hasattr(g, "free_blocks") else g
        if free != total:
            held[name] = total - free
    return held


def assert_instances_idle(statuses: Iterable[Any]) -> None:
    """Every instance status shows all blocks free and nothing queued or running."""
    busy = busy_instances(statuses)
    assert not busy, "instances not idle: " + "; ".join(
        f"{s.name}: {s.free_blocks} of {s.total_blocks} blocks free, {s.queue_depth} queued, "
        f"{s.running} running, V4 group blocks held {_groups_held(s)}" for s in busy)


def kv_threads() -> list[str]:
    """Names of the live KV transfer threads (pairs, acceptors, connectors), sorted."""
    return sorted(t.name for t in threading.enumerate() if KV_THREAD.match(t.name))


def assert_no_kv_threads(before: Iterable[str] = ()) -> None:
    """No KV transfer thread is alive now beyond those of ``before`` (taken before the test
    started its own)."""
    left = sorted((Counter(kv_threads()) - Counter(before)).elements())
    assert not left, f"KV threads left: {left}"


def project_threads() -> list[str]:
    """Names of the live threads the project starts (KV transfer, rank loops, step
    channels), sorted."""
    return sorted(t.name for t in threading.enumerate() if PROJECT_THREAD.match(t.name))


def wait_threads_gone(before: Iterable[str] = (), timeout_s: float = 5.0,
                      names: Callable[[], list[str]] = project_threads) -> None:
    """Wait until the live ``names()`` threads are those of ``before`` (taken before the
    test started its own).

    Raises:
        AssertionError: threads left after ``timeout_s`` (names them).
    """
    expected = Counter(before)
    _wait(lambda: sorted((Counter(names()) - expected).elements()), timeout_s, "threads left")


def _wait(problems: Callable[[], list[str]], timeout_s: float, what: str) -> None:
    """Poll ``problems()`` until it is empty; fail with the last ones after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = problems()
        if not found:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} after {timeout_s:g} s: " + "; ".join(found))
        time.sleep(0.02)

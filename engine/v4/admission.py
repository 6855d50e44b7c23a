"""Admission of DeepSeek-V4 requests by what they will hold per KV group (docs/engine.md
"DeepSeek-V4"; the issue's "decode reserves what it will hold, not prompt-length x layers").

A V4 request's rows live in the runner's per-group pools (:mod:`engine.v4.block_table`), taken
as it grows and, for the sliding window, given back as it advances. Admission commits, per
group, the most blocks the request will ever hold (:func:`engine.kv_groups.reservation`
over its whole life: prompt for prefill, prompt + max_tokens for decode and colocated, written
``chunk_size`` tokens a step): window blocks bounded by the window plus one step, compressed
entries at ``1 / ratio`` of the tokens (indexer keys in the same rows), one state block per
compressed kind. A request is admitted only when every group's committed blocks plus its own
fit the group's pool, so the blocks of every admitted request's every step (and of a decode
rebuild) are always free: nothing fails for lack of V4 blocks after admission. The commitment
goes back when the scheduler frees the request's block set (:meth:`V4Admission.release`, from
:meth:`engine.v4.runner.V4Runner.release`), exactly once per set.

The scheduler's own pool then holds only what the request's slots carry: its staging rows on
a PD role (:func:`engine.v4.staging.staged_rows` of the prompt, written by prefill and the
transfer into its first slots; decode keeps only the first block once the cache is rebuilt),
one block on a colocated one (the block set that names the request's cache). Its blocks are
no longer a per-token budget for V4.
"""

from __future__ import annotations

import threading

from engine.block_pool import BlockPool, BlockSet
from engine.request import RequestSpec
from engine.kv_groups import kv_groups, reservation
from engine.v4.config import V4Config
from engine.v4.kv_spec import layer_specs
from engine.v4.staging import staging_blocks_for


class V4Admission:
    """Per-group block commitments of one rank's admitted V4 requests (the scheduler's
    ``admission``, :class:`engine.scheduler.Scheduler`).

    Args:
        config: the model's. pools: the runner's group pools (``kv_groups`` names).
        block_size: the scheduler pool's (tokens per block: its slots per block).
        staged: a PD role (its scheduler blocks carry the staging rows), else colocated.

    NOTE: thread-safe: admission runs under the leader's lock, releases come from whichever
    thread frees a block set.
    """

    def __init__(self, config: V4Config, pools: dict[str, BlockPool], block_size: int, *,
                 staged: bool) -> None:
        self.config, self.pools, self.block_size, self.staged = config, pools, block_size, staged
        self.groups = kv_groups(layer_specs(config))
        self._committed = {g.name: 0 for g in self.groups}
        self._by_set: dict[int, dict[str, int]] = {}  # block set id -> its commitment
        self._lock = threading.Lock()

    def scheduler_blocks(self, spec: RequestSpec) -> int:
        """Scheduler-pool blocks ``spec`` takes: its staging rows' (PD) or one (colocated)."""
        if not self.staged:
            return 1
        return staging_blocks_for(self.config, spec.num_prompt_tokens, self.block_size)

    def pool_advice(self, role: str) -> str:
        """What to change when a request needs more scheduler blocks than the pool has in all
        (``role``'s section): PD, its staging pool's ``v4_staging_blocks`` (a shorter prompt
        need not help: :func:`~engine.v4.staging.staging_blocks_for` is not monotonic in the
        prompt length; config load holds the key to the most any prompt up to
        ``max_model_len`` takes, :func:`~engine.v4.staging.most_staging_blocks`); colocated
        (one block a request), ``num_kv_blocks``."""
        if not self.staged:
            return "raise num_kv_blocks"
        return (f"raise {role}.v4_staging_blocks (the DeepSeek-V4 staging pool; a shorter "
                "prompt can take more staging blocks, so shortening it need not help)")

    def need(self, num_tokens: int, step_tokens: int) -> dict[str, int]:
        """Blocks per group a request commits: the most it holds on its way to ``num_tokens``
        tokens written ``step_tokens`` (>= 1) at a time."""
        sizes = {name: pool.block_size for name, pool in self.pools.items()}
        return reservation(self.groups, sizes, num_tokens, max(1, step_tokens))

    def refusal(self, need: dict[str, int]) -> str | None:
        """Why a request committing ``need`` can never be admitted here (a group's need is
        over its whole pool), or None."""
        over = {name: (n, self.pools[name].num_blocks) for name, n in need.items()
                if n > self.pools[name].num_blocks}
        if not over:
            return None
        return ("the request's DeepSeek-V4 state needs more blocks than this instance has in "
                "all (group: needed, total): " + ", ".join(
                    f"{name}: {n}, {total}" for name, (n, total) in over.items())
                + ": shorten the prompt or max_tokens, or raise num_kv_blocks (the group pools "
                "hold max_num_seqs requests of model.max_model_len within its budget)")

    def can_admit(self, need: dict[str, int]) -> bool:
        """True when ``need`` fits next to every admitted request's commitment. No side
        effect."""
        with self._lock:
            return all(self._committed[name] + n <= self.pools[name].num_blocks
                       for name, n in need.items())

    def commit(self, block_set: BlockSet, need: dict[str, int]) -> None:
        """Commit ``need`` for the request whose scheduler blocks are ``block_set`` (after
        :meth:`can_admit`, under the same lock as it).

        Raises:
            ValueError: ``block_set`` already has a commitment.
        """
        with self._lock:
            if block_set.set_id in self._by_set:
                raise ValueError(f"block set {block_set.set_id} is already committed")
            self._by_set[block_set.set_id] = dict(need)
            for name, n in need.items():
                self._committed[name] += n

    def release(self, block_set: BlockSet) -> None:
        """The scheduler freed ``block_set``: its commitment goes back (none: no-op; the pool
        frees a set once, so this runs once per set)."""
        with self._lock:
            need = self._by_set.pop(block_set.set_id, None)
            for name, n in (need or {}).items():
                self._committed[name] -= n

    def committed(self) -> dict[str, int]:
        """Blocks committed now, per group (all 0 when nothing is admitted)."""
        with self._lock:
            return dict(self._committed)

    def uncommitted(self) -> dict[str, int]:
        """Blocks per group a new request may still commit (pool size less what admitted
        requests committed): the decode leader reports them with its free blocks in every
        event frame, so the router's admission queue waits on them
        (:class:`orchestrator.router.admission.AdmissionQueue`)."""
        with self._lock:
            return {name: self.pools[name].num_blocks - n for name, n in self._committed.items()}

    def describe(self, need: dict[str, int]) -> str:
        """The groups ``need`` does not fit now, for a retryable refusal's message."""
        with self._lock:
            short = [f"{name}: {n} needed, {self.pools[name].num_blocks - self._committed[name]}"
                     f" of {self.pools[name].num_blocks} uncommitted"
                     for name, n in need.items()
                     if self._committed[name] + n > self.pools[name].num_blocks]
        return "DeepSeek-V4 blocks short (" + "; ".join(short) + ")" if short else ""

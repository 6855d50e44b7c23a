"""Leader-side pieces shared by the three roles: the scheduler step and its token events.

A leader step is schedule -> execute (all ranks) -> sample -> update, with a typed
:class:`SchedulerOutput` between the stages and a :class:`StepResult` out of it. Roles add
what happens around it (KV sends on prefill, KV completion on decode) through the role hooks
listed in prefill_worker/rank.py.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.block_pool import BlockPool
from engine.sampling import sample
from engine.scheduler import RolePolicy, Request, Scheduler, SchedulerOutput, finish_reason
from prefill_worker.messages import InstanceStatusInfo, RequestSpec, TokenEvent
from prefill_worker.rank import RankBase

MAX_TOMBSTONES = 10_000
# NOTE: long against the race it guards (calls of one request a few ms apart), short enough
# that a client reusing a finished request's id is not refused for long.
TOMBSTONE_TTL_S = 30.0
# Seconds a status snapshot waits for each rank.
STATUS_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class StepResult:
    """What one leader step did.

    Attributes:
        output: what the scheduler scheduled (the step's chunks).
        sampled: request id -> the token sampled for it this step (requests whose chunk
            reached their last known token; may be empty).
    """

    output: SchedulerOutput
    sampled: dict[str, int]


class LeaderRank(RankBase):
    """A rank whose rank 0 owns a scheduler and block pool; ``setup_leader`` builds them.

    Subclasses set ``policy`` (the scheduler's role policy) and ``source`` (their
    ``TokenEvent.source``), and call ``setup_leader`` from ``setup_role`` on rank 0.
    """

    policy: RolePolicy
    source: str

    def setup_leader(self) -> None:
        """Rank 0, from ``setup_role``: build the block pool, the scheduler and tombstones."""
        cfg = self.cfg.scheduler
        self.pool = BlockPool(cfg.num_kv_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.pool, self.policy, chunk_size=cfg.chunk_size,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   max_num_seqs=cfg.max_num_seqs)
        self.eos_token_ids = frozenset(self.runner.model_config.eos_token_ids)
        # NOTE: aborts that found nothing: a reserve/prefill/generate of the same id can still
        # be on its way (actor calls run on several threads), and must not start afterwards.
        self._tombstones: OrderedDict[str, float] = OrderedDict()

    def add_tombstone(self, request_id: str) -> None:
        """Remember an abort that found nothing, for ``TOMBSTONE_TTL_S`` (bounded count)."""
        self._tombstones[request_id] = time.monotonic()
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def has_tombstone(self, request_id: str) -> bool:
        """An abort of ``request_id`` arrived shortly before the request itself."""
        at = self._tombstones.get(request_id)
        return at is not None and time.monotonic() - at < TOMBSTONE_TTL_S

    def too_big(self, blocks_needed: int) -> str | None:
        """Why a request needing ``blocks_needed`` blocks can never run here, or None."""
        if blocks_needed <= self.pool.num_blocks:
            return None
        return (f"request needs {blocks_needed} KV blocks of "
                f"{self.cfg.scheduler.block_size} tokens; {self.cfg.name} has "
                f"{self.pool.num_blocks} in all: shorten the prompt or max_tokens, or raise "
                "num_kv_blocks")

    def enqueue(self, spec: RequestSpec) -> bool:
        """Queue a new request (caller holds the lock); one that can never fit gets an error
        event instead. True when queued."""
        if self.has_tombstone(spec.request_id):
            self.emit(TokenEvent(spec.request_id, (), "abort", source=self.source,
                                 instance=self.cfg.name))
            return False
        reason = self.too_big(self.scheduler.blocks_for(spec))
        if reason is not None:
            self.emit(TokenEvent(spec.request_id, (), "error", reason, self.source,
                                 self.cfg.name))
            return False
        self.scheduler.add(Request(spec))
        self._wake.set()
        return True

    def sample_step(self, out: SchedulerOutput, logits) -> dict[str, int]:
        """Sample the next token of every chunk that completes its request's known tokens."""
        rows = [i for i, c in enumerate(out.chunks) if c.completes]
        if not rows:
            return {}
        reqs = [out.chunks[i].request for i in rows]
        tokens = sample(logits[rows], [r.spec.sampling for r in reqs],
                        [len(r.output_token_ids) for r in reqs])
        return {r.request_id: t for r, t in zip(reqs, tokens)}

    def finish_sampled(self, sampled: dict[str, int], *, free: bool = True) -> list[Request]:
        """Emit one event per sampled token; remove finished requests. Returns those removed."""
        done: list[Request] = []
        for rid, token in sampled.items():
            req = self.scheduler.find(rid)
            if req is None:  # aborted while the step ran
                continue
            reason = finish_reason(req, self.eos_token_ids)
            handoff = self.policy.stop_after_first_token
            self.emit(TokenEvent(rid, (token,), reason, source=self.source,
                                 instance=self.cfg.name))
            if reason is not None or handoff:
                done.append(self.scheduler.remove(rid, free=free))
        return done

    def leader_step(self, step_inputs_for: Callable[[SchedulerOutput], Any] | None = None
                    ) -> StepResult | None:
        """schedule -> execute on all ranks -> sample -> update; None when nothing was
        scheduled. ``step_inputs_for(output)`` makes the role's per-step inputs that every
        rank's ``after_step`` receives (prefill: the chunks' KV transfers)."""
        out = self.scheduler.schedule()
        if not out:
            return None
        step_inputs = step_inputs_for(out) if step_inputs_for else None
        logits = self.run_step(out.steps, step_inputs)
        sampled = self.sample_step(out, logits)
        self.scheduler.update(out, sampled)
        return StepResult(out, sampled)

    def fail_requests(self, requests: list[Request], error: str) -> None:
        for req in requests:
            self.scheduler.remove(req.request_id)
            self.emit(TokenEvent(req.request_id, (), "error", error, source=self.source,
                                 instance=self.cfg.name))

    def fail_all(self, error: str) -> None:
        with self._lock:
            self.fail_requests([*self.scheduler.running, *self.scheduler.waiting], error)

    def num_active(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def status(self) -> InstanceStatusInfo:
        # NOTE: asks every rank (bounded), so a dead rank shows as an unreachable instance.
        ranks = self.ranks_info(timeout_s=STATUS_TIMEOUT_S)
        return InstanceStatusInfo(
            name=self.cfg.name, role=self.cfg.role, tp=self.cfg.parallel.tp, ranks=ranks,
            queue_depth=len(self.scheduler.waiting), running=len(self.scheduler.running),
            free_blocks=self.pool.num_free_blocks, total_blocks=self.pool.num_blocks,
            outstanding_tokens=self.scheduler.num_outstanding_tokens, **self.transfer_stats())

    def transfer_stats(self) -> dict:
        """Role hook, leader, inside :meth:`status` (not under the lock): the role's
        :class:`InstanceStatusInfo` fields by name (prefill: ``kv_bytes_sent``, ``transfers``;
        decode: ``kv_failures``). May ask every rank (bounded)."""
        return {}

"""Leader-side pieces shared by the three roles: the scheduler step and its token events.

A leader step is schedule -> execute (all ranks) -> sample -> update, with a typed
:class:`SchedulerOutput` between the stages and a :class:`StepResult` out of it. Roles add
what happens around it (KV sends on prefill, KV completion on decode) through the role hooks
listed in rank/rank.py.

Isolation: a request can only ever fail itself. A row the sampler cannot sample fails its
request alone (``StepResult.failed``). A step that raises for any reason but a rank failure
is run again one chunk at a time: a chunk that fails alone fails its request, the others go on
with the tokens a clean step gives them (each chunk recomputes the same KV into the same
slots; on prefill a recomputed chunk's KV may be sent twice, which the decode side counts once:
it marks (layer, token) cells, see kv_transfer/tracker.py).

Lockstep (``ep`` with several DP ranks, rank/dp_sync.py): a role's ``step`` asks
:meth:`LeaderRank.agree_to_step` before taking its lock; when the round runs, ``leader_step``
runs a forward on every rank even with nothing scheduled (an empty one), and each chunk
re-run of a failed step opens a round of its own, so the other DP ranks meet every forward.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.error_text import first_line
from engine.block_pool import BlockPool
from engine.sampling import RowFailure, sample
from engine.scheduler import RolePolicy, Scheduler, SchedulerOutput, finish_reason
from engine.request import Request
from rank.dp_sync import DPGroupBroken
from rank.messages import InstanceStatusInfo, TokenEvent
from engine.request import RequestSpec
from rank.rank import RankBase
from rank.failures import RankFailure, RankHung

log = logging.getLogger(__name__)

MAX_TOMBSTONES = 10_000
# NOTE: long against the race it guards (calls of one request a few ms apart), short enough
# that a client reusing a finished request's id is not refused for long.
TOMBSTONE_TTL_S = 30.0
# Seconds a status snapshot waits for the other ranks (status answers within a few seconds
# even when a rank hangs).
STATUS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class StepResult:
    """What one leader step did.

    Attributes:
        output: what the scheduler scheduled (the step's chunks).
        sampled: request id -> the token sampled for it this step (requests whose chunk
            reached their last known token; may be empty).
        failed: request id -> why that request failed this step (its row could not be
            sampled, or its chunk failed alone); the role ends each with an error event.
    """

    output: SchedulerOutput
    sampled: dict[str, int]
    failed: dict[str, str]


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
        event instead. True when queued.

        Raises:
            InstanceOutOfService: the instance is broken.
        """
        self.check_in_service()
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

    def agree_to_step(self) -> bool:
        """Leader loop, before the role's ``step`` takes the lock: whether this iteration may
        run a forward. True without a DP sync (``leader_step`` runs one only when it
        schedules something); with one, True when any DP rank of the role has queued or
        running requests, and then ``leader_step`` runs a forward whatever it schedules.

        Raises:
            DPGroupBroken: another DP rank did not meet the round (a :class:`RankFailure`).
        """
        if self.dp_sync is None:
            return True
        # NOTE: read without the lock: a request queued right after this read runs in this
        # round if some DP rank has work, else in the next (enqueue sets the wake event).
        return self.dp_sync.any_work(bool(self.scheduler.running or self.scheduler.waiting))

    def _execute(self, out: SchedulerOutput,
                 step_inputs_for: Callable[[SchedulerOutput], Any] | None) -> StepResult:
        """execute ``out`` on all ranks -> sample -> update the counters."""
        step_inputs = step_inputs_for(out) if step_inputs_for else None
        logits = self.run_step(out.steps, step_inputs)
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        rows = [i for i, c in enumerate(out.chunks) if c.completes]
        if rows:
            reqs = [out.chunks[i].request for i in rows]
            # NOTE: every row samples on decode: no [B, V] copy then
            picked = logits if len(rows) == logits.shape[0] else logits[rows]
            with self.step_timer.phase("sample"):
                tokens = sample(picked, [r.spec.sampling for r in reqs],
                                [len(r.output_token_ids) for r in reqs])
            for req, token in zip(reqs, tokens):
                if isinstance(token, RowFailure):
                    failed[req.request_id] = f"{self.cfg.name}: {token.reason}"
                else:
                    sampled[req.request_id] = token
        with self.step_timer.phase("schedule"):
            self.scheduler.update(out, sampled)
        return StepResult(out, sampled, failed)

    def _execute_each(self, out: SchedulerOutput,
                      step_inputs_for: Callable[[SchedulerOutput], Any] | None,
                      error: Exception) -> StepResult:
        """After ``out`` raised ``error``: run each chunk alone; one that fails again fails
        its request only.

        Raises:
            RankFailure: a rank died or hung meanwhile.
        """
        log.warning("%s: a step of %d request(s) failed (%s)%s", self.cfg.name,
                    len(out.chunks), first_line(error),
                    "; running each alone"
                    if len(out.chunks) > 1 or self.dp_sync is not None else "")
        # NOTE: with a DP sync even one chunk runs again: its round tells a broken EP group
        # (DPGroupBroken: out of service, requests retryable) from a bad request
        if len(out.chunks) == 1 and self.dp_sync is None:
            return StepResult(out, {}, {out.chunks[0].request.request_id:
                                        self._step_error(error)})
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        for chunk in out.chunks:
            if self.dp_sync is not None:
                # NOTE: under the lock, like the forward itself: one round per re-run forward
                self.dp_sync.any_work(True)
            try:
                solo = self._execute(SchedulerOutput((chunk,)), step_inputs_for)
            except RankFailure:
                raise
            except Exception as exc:  # noqa: BLE001 - this chunk fails alone: its request
                failed[chunk.request.request_id] = self._step_error(exc)
                continue
            sampled.update(solo.sampled)
            failed.update(solo.failed)
        return StepResult(out, sampled, failed)

    def _step_error(self, exc: Exception) -> str:
        return f"{self.cfg.name}: the model step failed for this request: {first_line(exc)}"

    def finish_sampled(self, sampled: dict[str, int], *, free: bool = True) -> list[Request]:
        """Emit one event per sampled token; remove finished requests. Returns those removed.
        Timed as the step's ``emit`` phase."""
        with self.step_timer.phase("emit"):
            return self._finish_sampled(sampled, free)

    def _finish_sampled(self, sampled: dict[str, int], free: bool) -> list[Request]:
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
        """schedule -> execute on all ranks -> sample -> update; None when nothing ran.
        ``step_inputs_for(output)`` makes the role's per-step inputs that every rank's
        ``after_step`` receives (prefill: the chunks' KV transfers). A step that raises is run
        again chunk by chunk (module docstring). Caller holds the lock and got True from
        :meth:`agree_to_step`: in a lockstep round with nothing scheduled, an empty forward
        runs on every rank (a result with no chunks).

        Raises:
            RankFailure: a rank died or hung, or another DP rank did not meet a round (the
                caller's loop takes the instance out of service).
        """
        with self.step_timer.phase("schedule"):
            out = self.scheduler.schedule()
        if not out:
            if self.dp_sync is None:
                return None
            self._run_empty_step()
            return StepResult(out, {}, {})
        try:
            return self._execute(out, step_inputs_for)
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated below
            return self._execute_each(out, step_inputs_for, exc)

    def _run_empty_step(self) -> None:
        """An empty forward on every rank (a lockstep round with nothing scheduled here).

        Raises:
            RankFailure: a rank died or hung; DPGroupBroken: the forward failed (with no
                request in it, only the role's collectives can have failed).
        """
        try:
            self.run_step([])
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - no request to blame: the EP group broke
            raise DPGroupBroken(f"{self.cfg.name}: an empty lockstep forward failed: "
                                f"{first_line(exc)}") from exc

    def fail_request(self, request_id: str, error: str, retryable: bool = False) -> None:
        """Role hook, leader, caller holds the lock: end one queued or running request with an
        error event and free its blocks (exactly once). ``retryable``: the instance failed,
        not the request (the router may place it again). Never raises."""
        self.emit(TokenEvent(request_id, (), "error", error, source=self.source,
                             instance=self.cfg.name, retryable=retryable))
        self.scheduler.remove(request_id)

    def fail_requests(self, failed: dict[str, str]) -> None:
        """End each request of ``failed`` (request id -> error); caller holds the lock."""
        for rid, error in failed.items():
            self.fail_request(rid, error)

    def fail_all(self, error: str) -> None:
        """End every queued or running request with ``error``, an instance failure (retryable
        elsewhere); never raises."""
        with self._lock:
            for req in [*self.scheduler.running, *self.scheduler.waiting]:
                try:
                    self.fail_request(req.request_id, error, retryable=True)
                except Exception:  # noqa: BLE001 - the others still get their event
                    log.exception("%s: failing %s failed", self.cfg.name, req.request_id)

    def num_active(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def status(self) -> InstanceStatusInfo:
        """Snapshot within a few seconds whatever the ranks do (each rank call is bounded by
        ``STATUS_TIMEOUT_S``; prefill makes three).

        Asks every rank (bounded): a dead one takes the instance out of service (``broken``);
        one that does not answer in time is reported by a TimeoutError (the step deadline or
        the router's health checks judge whether it hangs).

        Raises:
            TimeoutError: a rank did not answer within ``STATUS_TIMEOUT_S``.
        """
        try:
            ranks = self.ranks_info(timeout_s=STATUS_TIMEOUT_S)
            stats = self.transfer_stats(STATUS_TIMEOUT_S)
        except RankHung as exc:
            raise TimeoutError(f"{self.cfg.name}: {exc}") from exc
        except RankFailure as exc:
            self.mark_broken(str(exc))
            ranks, stats = (), self.transfer_stats(None)
        return InstanceStatusInfo(
            name=self.cfg.name, role=self.cfg.role, tp=self.cfg.parallel.tp, ranks=ranks,
            queue_depth=len(self.scheduler.waiting), running=len(self.scheduler.running),
            free_blocks=self.pool.num_free_blocks, total_blocks=self.pool.num_blocks,
            outstanding_tokens=self.scheduler.num_outstanding_tokens, broken=self.broken,
            step_timings=self.step_timer.snapshot(), **stats)

    def transfer_stats(self, timeout_s: float | None) -> dict:
        """Role hook, leader, inside :meth:`status` (not under the lock): the role's
        :class:`InstanceStatusInfo` fields by name (prefill: ``kv_bytes_sent``, ``transfers``;
        decode: ``kv_failures``). May ask every rank within ``timeout_s``; None: only the
        leader's own numbers (a rank is gone).

        Raises:
            RankFailure: a rank is gone or did not answer.
        """
        return {}

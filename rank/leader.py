"""What rank 0 of every role keeps: the scheduler and block pool, the token stream to the routers
(rank/event_stream.py; a ``poll`` queue until a router subscribes), tombstones, whether the
instance is in service, and its step.

A role (rank/role.py) composes this object: it queues requests with :meth:`Leader.enqueue`,
runs :meth:`Leader.step` (rank/leader_step.py) under :attr:`Leader.lock` from its own step,
and ends requests with :meth:`Leader.fail_request` and :meth:`Leader.emit_end`.

Out of service: a follower that is dead or hung is a :class:`~rank.failures.RankFailure`;
:meth:`Leader.mark_broken` takes the instance out of service at once (``broken`` holds why),
the loop (rank/rank.py) ends every request with an error event, and new work is refused with
``InstanceOutOfService`` until orch replaces the instance.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import replace

from engine.block_pool import BlockPool
from engine.logits_process import LogitsStage
from engine.request import Request, RequestSpec
from engine.scheduler import RolePolicy, Scheduler, finish_reason
from rank.config import InstanceConfig
from rank.dp_sync import DPSync
from rank.event_stream import EventStream
from rank.leader_step import LeaderStep, StepInputsFor, StepResult
from rank.messages import InstanceOutOfService, InstanceStatusInfo, TokenEvent
from rank.spmd import SPMDGroup
from rank.step_lock import StepLock
from rank.step_timing import FirstTokenClock, with_flush

log = logging.getLogger(__name__)

MAX_TOMBSTONES = 10_000
# NOTE: long against the race it guards (calls of one request a few ms apart), short enough
# that a client reusing a finished request's id is not refused for long.
TOMBSTONE_TTL_S = 30.0

# Ends one request: (request id, error, retryable).
FailFn = Callable[[str, str, bool], None]


class Leader:
    """Rank 0's shared state.

    Args:
        cfg: the instance's config.
        policy: the role's scheduler policy. source: the role's ``TokenEvent.source``.
        eos_token_ids: the model's end-of-sequence tokens.
        group: the instance's ranks (:class:`~rank.spmd.SPMDGroup`).
        dp_sync: the role's DP sync (``ep`` with ``dp > 1``), else None.
        num_blocks: the block pool's size when the runner says (its ``scheduler_blocks``:
            MLA's ``kv`` pool, :func:`engine.pool_plan.plan_pools`; DeepSeek-V4's staging pool
            of a PD role); None (a runner that does not say): ``num_kv_blocks``.

    NOTE: :attr:`lock` guards the scheduler, the pool and the role's own request tables
    between actor calls (Ray threads) and the loop thread; :attr:`wake` wakes the loop.
    """

    def __init__(self, cfg: InstanceConfig, policy: RolePolicy, source: str,
                 eos_token_ids: Iterable[int], group: SPMDGroup,
                 dp_sync: DPSync | None, num_blocks: int | None = None) -> None:
        sched = cfg.scheduler
        self.cfg, self.policy, self.source, self.ranks = cfg, policy, source, group
        self.pool = BlockPool(num_blocks or sched.num_kv_blocks, sched.block_size,
                              salt=cfg.cache_salt)
        self.scheduler = Scheduler(self.pool, policy, chunk_size=sched.chunk_size,
                                   max_num_batched_tokens=sched.max_num_batched_tokens,
                                   max_num_seqs=sched.max_num_seqs,
                                   num_speculative_tokens=sched.num_speculative_tokens)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.step_timer = group.timer
        self.first_token = FirstTokenClock()  # NOTE: followed on prefill / colocated only
        self.lock = StepLock()
        self.wake = threading.Event()
        # NOTE: why the instance is out of service (a rank is dead or hung), set once; read
        # without the lock (the loop ends whatever a racing RPC still queued).
        self.broken: str | None = None
        stage = LogitsStage(self.eos_token_ids, cfg.checkpoint_dir)
        self._step = LeaderStep(cfg.name, self.scheduler, group, dp_sync, stage,
                                self.eos_token_ids)
        # NOTE: events wait in _events; the loop moves them to the stream once a router
        # subscribed, else ``poll`` takes them
        self.stream = EventStream(cfg.name, cfg.parallel.bind_host or "127.0.0.1")
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        # NOTE: aborts that found nothing: a reserve/prefill/generate of the same id can still
        # be on its way (actor calls run on several threads), and must not start afterwards.
        self._tombstones: OrderedDict[str, float] = OrderedDict()
        # NOTE: time.monotonic() when every rank was last known alive (a step ran on all of
        # them, or they all answered a status); a leader without followers is its own proof
        self._ranks_seen_at: float | None = None

    def close(self) -> None:
        """Release the step's threads and the event stream (the rank is shutting down)."""
        self._step.close()
        self.stream.close()

    # ---- events -------------------------------------------------------------------------
    def emit(self, event: TokenEvent) -> None:
        """Queue ``event`` for the routers (the loop's next :meth:`flush_events`).

        NOTE: one queue for every thread, whether a router subscribed or not, so the order
        of emission is the order on the stream (a subscription racing an emit reorders
        nothing)."""
        self._events.put(event)

    def open_events(self, subscriber: str, beat_s: float | None = None
                    ) -> tuple[str, int, bytes, str]:
        """A router subscribes (Ray call): events from now on, and those no ``poll`` took,
        go to the stream, with a frame at least every ``beat_s`` seconds when given (its
        health monitor's proof of life); (host, port, token, epoch) of it."""
        address = self.stream.open(subscriber, beat_s)
        self.wake.set()
        return address

    def flush_events(self) -> None:
        """The loop thread, after each iteration: one frame of the queued events, the free
        KV blocks and (DeepSeek-V4) the group pools' uncommitted blocks to every subscribed
        router (nothing when none changed)."""
        if not self.stream.subscribed:
            return
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event.ttft_phases:
                event = replace(event, ttft_phases=with_flush(event.ttft_phases))
            self.stream.add(event)
        kv = self.pool.take_events()  # NOTE: the prefix cache's changes ride the same frame
        if kv:
            self.stream.add(TokenEvent("", source=self.source, instance=self.cfg.name,
                                       kv_events=kv))
        self.stream.flush(self.pool.num_free_blocks, self.ranks_age_s(),
                          self.scheduler.admission_free())

    def ranks_alive(self, at: float) -> None:
        """Every rank was alive at ``at`` (``time.monotonic()``)."""
        self._ranks_seen_at = max(at, self._ranks_seen_at or at)

    def ranks_age_s(self) -> float | None:
        """Seconds since every rank was last known alive (0 without followers); None when not
        known (rides each event frame: the router's monitor skips pings while it is young)."""
        if not self.ranks.followers:
            return 0.0
        seen = self._ranks_seen_at
        return None if seen is None else max(0.0, time.monotonic() - seen)

    def emit_end(self, request_id: str, reason: str, error: str | None = None,
                 retryable: bool = False) -> None:
        """The last event of a request that produced no token here: ``reason`` "abort" or
        "error" (with ``error``; ``retryable``: the instance failed, not the request)."""
        self.emit(TokenEvent(request_id, (), reason, error, self.source, self.cfg.name,
                             retryable=retryable))
        self.wake.set()  # NOTE: an actor thread's event goes out at the loop's next flush

    def poll(self, timeout_s: float, kv_events: bool = False) -> list[TokenEvent]:
        """Events since the last poll while no router subscribed (tests drive a leader this
        way); waits up to ``timeout_s`` for one. With ``kv_events`` the prefix cache's changes
        since they were last taken come last, on an event of no request
        (``TokenEvent.kv_events``)."""
        out: list[TokenEvent] = []
        try:
            out.append(self._events.get(timeout=max(0.0, timeout_s)))
            while True:
                out.append(self._events.get_nowait())
        except queue.Empty:
            pass
        kv = self.pool.take_events() if kv_events else None
        if kv:
            out.append(TokenEvent("", source=self.source, instance=self.cfg.name, kv_events=kv))
        return out

    # ---- in service ---------------------------------------------------------------------
    def mark_broken(self, reason: str) -> None:
        """Take the instance out of service (the first reason stays); the loop then ends every
        request with an error, and new work is refused. Never blocks."""
        if self.broken is None:
            self.broken = reason
            log.error("%s is out of service: %s", self.cfg.name, reason)
        self.wake.set()

    def out_of_service(self) -> InstanceOutOfService:
        """The error new work gets while ``broken``."""
        return InstanceOutOfService(f"{self.cfg.name} is out of service: {self.broken} (orch "
                                    "restarts it)")

    def check_in_service(self) -> None:
        """Raises InstanceOutOfService while the instance is broken."""
        if self.broken is not None:
            raise self.out_of_service()

    # ---- requests -----------------------------------------------------------------------
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
                f"{self.pool.num_blocks} in all: {self.scheduler.pool_advice(self.cfg.role)}")

    def enqueue(self, spec: RequestSpec) -> bool:
        """Queue a new request (caller holds the lock); one aborted before it came gets an
        abort event, one that can never fit an error event instead. True when queued.

        Raises:
            InstanceOutOfService: the instance is broken.
        """
        self.check_in_service()
        if self.has_tombstone(spec.request_id):
            self.emit_end(spec.request_id, "abort")
            return False
        reason = self.too_big(self.scheduler.blocks_for(spec)) or self.scheduler.refusal(spec)
        if reason is not None:
            self.emit_end(spec.request_id, "error", reason)
            return False
        self.scheduler.add(Request(spec))
        if self.source != "decode":
            self.first_token.arrived(spec.request_id)
        self.wake.set()
        return True

    # ---- the step -----------------------------------------------------------------------
    def agree_to_step(self) -> bool:
        """Before a role's step takes the lock (see :meth:`LeaderStep.agree`).

        Raises:
            DPGroupBroken: another DP rank did not meet the round.
        """
        self.lock.give_way()  # NOTE: a request's call waiting for the lock goes first
        return self._step.agree()

    @property
    def in_lockstep(self) -> bool:
        """Whether the role steps in DP lockstep (``ep`` with ``dp > 1``: an idle DP rank
        still meets every round)."""
        return self._step.dp_sync is not None

    def leave_lockstep(self) -> None:
        """The loop ended (shutdown): an in-service leader of a lockstep role tells the other
        DP ranks with one last round, so none waits the step bound for it (rank/dp_sync.py,
        Stopping); an out-of-service one does no round any more."""
        if self.broken is None:
            self._step.leave()

    def step(self, step_inputs_for: StepInputsFor | None = None) -> StepResult | None:
        """One step on all ranks, caller holds the lock (see :meth:`LeaderStep.run`).

        Raises:
            RankFailure: a rank died or hung, or another DP rank did not meet a round.
        """
        started, began = time.perf_counter(), time.monotonic()
        result = self._step.run(step_inputs_for)
        if result is not None:  # NOTE: its forward's collectives met every rank
            self.ranks_alive(began)
        if result is not None and self.source != "decode":
            self.first_token.stepped([c.request.request_id for c in result.output.chunks],
                                     started, self.step_timer.pending())
        return result

    def finish_sampled(self, sampled: dict[str, int], *, free: bool = True,
                       accepted: dict[str, tuple[int, ...]] | None = None) -> list[Request]:
        """Emit one event per sampled token (after the drafts ``accepted`` for it, in the same
        event) and flush them to the routers at once; remove finished requests (and, on
        prefill, every request: it leaves after its first token), freeing their blocks when
        ``free``. Returns those removed. Caller (the loop thread) holds the lock; timed as the
        step's ``emit`` phase."""
        accepted = accepted or {}
        with self.step_timer.phase("emit"):
            done: list[Request] = []
            for rid, token in sampled.items():
                req = self.scheduler.find(rid)
                if req is None:  # aborted while the step ran
                    continue
                reason = finish_reason(req, self.eos_token_ids)
                kept = accepted.get(rid, ())
                cached = req.num_cached_tokens \
                    if len(req.output_token_ids) == 1 + len(kept) else 0
                # NOTE: one entry per token, the kept drafts' too (rank/spec_verify.py)
                logprobs = tuple(req.output_logprobs[-1 - len(kept):]) \
                    if req.output_logprobs else ()
                first = self.first_token.phases_at_emit(rid) \
                    if len(req.output_token_ids) == 1 + len(kept) else ()
                self.emit(TokenEvent(rid, (*kept, token), reason, source=self.source,
                                     instance=self.cfg.name, num_cached_tokens=cached,
                                     logprobs=logprobs, ttft_phases=first))
                if reason is not None or self.policy.stop_after_first_token:
                    done.append(self.scheduler.remove(rid, free=free))
            # NOTE: out now, not after the role's bookkeeping (prefill: asking every rank
            # whether its sends are idle), which the loop's own flush waits for
            try:
                self.flush_events()
            except Exception:  # noqa: BLE001 - the loop's flush sends them again
                log.exception("%s: sending events failed", self.cfg.name)
            return done

    # ---- failures -----------------------------------------------------------------------
    def fail_request(self, request_id: str, error: str, retryable: bool = False) -> None:
        """End one queued or running request with an error event and free its blocks
        (exactly once); caller holds the lock. ``retryable``: the instance failed, not the
        request (the router may place it again). Never raises."""
        self.emit_end(request_id, "error", error, retryable)
        self.scheduler.remove(request_id)

    def fail_scheduled(self, error: str, fail: FailFn) -> None:
        """End every queued or running request with ``error``, an instance failure
        (retryable elsewhere), through the role's ``fail(request_id, error, True)``; never
        raises (a request whose ``fail`` raised is logged, the others still end)."""
        with self.lock:
            for req in [*self.scheduler.running, *self.scheduler.waiting]:
                try:
                    fail(req.request_id, error, True)
                except Exception:  # noqa: BLE001 - the others still get their event
                    log.exception("%s: failing %s failed", self.cfg.name, req.request_id)

    def num_scheduled(self) -> int:
        """Requests queued or running in the scheduler."""
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def status(self, ranks: tuple[tuple[int, str, str, int], ...],
               role_fields: dict) -> InstanceStatusInfo:
        """The instance's snapshot: ``ranks`` (rank, node, device, pid) and the role's own
        :class:`InstanceStatusInfo` fields by name."""
        queried, hits = self.pool.lookup_totals()
        rate, mean_len = self._step.spec_stats.snapshot()
        return InstanceStatusInfo(
            spec_acceptance_rate=rate, spec_mean_accepted_length=mean_len,
            name=self.cfg.name, role=self.cfg.role, tp=self.cfg.parallel.tp, ranks=ranks,
            queue_depth=len(self.scheduler.waiting), running=len(self.scheduler.running),
            free_blocks=self.pool.num_free_blocks, total_blocks=self.pool.num_blocks,
            outstanding_tokens=self.scheduler.num_outstanding_tokens, broken=self.broken,
            step_timings=self.step_timer.snapshot(), cached_blocks=self.pool.num_cached_blocks,
            prefix_hit_tokens=hits, prefix_queried_tokens=queried, **role_fields)

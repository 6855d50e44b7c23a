"""Prefill role: chunked prefill into a decode reservation, KV sent chunk by chunk.

Protocol (DESIGN.md "One request"), prefill side:

1. :class:`~rank.messages.Prefill` ``(spec, reservation)``: queue the request; blocks for its
   prompt are taken on this instance when the scheduler admits it.
2. Each step computes a chunk of each running prompt on every rank; as each layer writes its
   KV (or, with ``transfer.layerwise`` off, right after the model step), every rank queues
   its planned layers of those tokens to its decode peers (prefill_worker/kv_sends.py).
3. The step that completes the prompt samples the first token (TTFT), which goes straight to
   the router; every rank sends its completion records; the request leaves the scheduler but
   its blocks stay until every rank's sends for it are done ("draining"), then are freed once.

Eager launch (the router's ``router.eager_prefill``): ``Prefill(spec, None)`` computes the
prompt before decode's reservation exists (no V4, MTP or cp > 1: their KV to ship is made by
the step itself); :class:`~rank.messages.Attach` brings the reservation: the KV computed by
then ships at once (:func:`~prefill_worker.kv_sends.late_transfer`, under the leader lock, so
before any later chunk), the later chunks as computed. A prompt done before its ``Attach``
keeps its blocks ("unattached") until the ``Attach``, an abort, or ``ORPHAN_FACTOR`` completion
timeouts (then an error event, blocks freed once).

Abort: every rank cancels its queued sends and says so to the decode side (first, without the
leader lock: a forward in progress sends nothing more of it from its next layer on), then the
request leaves the queue; ``Abort`` returns only when no send into the reservation is still in
flight.
A request that fails (its chunk or its sampling, see rank/leader_step.py) ends the same way,
from the loop: error event, sends aborted on every rank, blocks freed once idle.

Out of service (a rank dead or hung): every request ends with an error event, the leader's own
sends are aborted (the decode side learns at once) and the blocks are freed without asking
the other ranks (nothing reuses them: new work is refused).

Rank calls (:meth:`PrefillRole.abort_kv`, :meth:`PrefillRole.sends_idle`) never run under the
leader lock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.block_pool import BlockSet
from engine.request import RequestSpec
from engine.scheduler import PREFILL, SchedulerOutput
from kv_transfer import KVPeer
from prefill_worker.kv_sends import (ChunkTransfer, KVSends, LayerSends, chunk_transfers,
                                     late_transfer, staged_transfers)
from rank.failures import RankFailure
from rank.messages import Abort, Attach, LeaderRequest, Prefill, Reservation, TransferRecord
from rank.role import RankParts, Role, not_taken

log = logging.getLogger(__name__)

# NOTE: a prompt computed without a reservation whose Attach never comes (its router gone) is
# freed after this many completion timeouts, as decode frees a reservation never admitted.
ORPHAN_FACTOR = 4


@dataclass(frozen=True)
class Unattached:
    """A prompt computed (first token out) before its reservation arrived: its blocks, its
    prompt length, and when it is given up (``time.monotonic()``)."""

    blocks: BlockSet
    end: int
    deadline: float


class PrefillRole(Role):
    """Role of a prefill instance. Requests: ``Prefill``, ``Attach``, ``Abort``. Rank-to-rank
    calls (every rank): :meth:`sends_idle`, :meth:`abort_kv`, :meth:`send_late`,
    :meth:`take_transfer_log`, :meth:`kv_bytes_sent`."""

    policy = PREFILL
    source = "prefill"

    def __init__(self, parts: RankParts) -> None:
        self.cfg = parts.cfg
        self.sends = KVSends(parts.runner, parts.cfg, parts.rank)
        self.leader = parts.leader
        self.staged_rows = getattr(parts.runner, "staged_rows", None)  # DeepSeek-V4
        self.chunk_rows = getattr(parts.runner, "chunk_rows", None)  # DeepSeek-V4
        # leader: the request tables (under the leader's lock)
        self.reservations: dict[str, Reservation] = {}
        self.draining: dict[str, BlockSet] = {}  # first token out, sends still running
        self.unattached: dict[str, Unattached] = {}  # first token out, no reservation yet
        # failed requests whose sends every rank still has to abort (outside the lock)
        self.kv_aborts: list[tuple[str, tuple[KVPeer, ...]]] = []

    # ---- every rank ---------------------------------------------------------------------
    def layer_hook(self, step_inputs: list[ChunkTransfer] | None) -> LayerSends | None:
        return self.sends.layer_hook(step_inputs)

    def after_step(self, step_inputs: list[ChunkTransfer] | None, output=None) -> None:
        self.sends.queue(step_inputs, output)

    def sends_idle(self, request_ids: list[str], timeout_s: float = 0.0) -> dict[str, bool]:
        """request id -> True when no send of it is queued or in flight on this rank (waits
        up to ``timeout_s`` for each); an idle request's transfer record is closed."""
        return self.sends.idle(request_ids, timeout_s)

    def abort_kv(self, request_id: str, peers: tuple[KVPeer, ...]) -> None:
        self.sends.abort(request_id, peers)

    def send_late(self, transfer: ChunkTransfer) -> None:
        """KV computed before the request's reservation arrived (:meth:`attach`)."""
        self.sends.send_late(transfer)

    def take_transfer_log(self) -> tuple[TransferRecord, ...]:
        """This rank's closed per-pair transfer records since the last call."""
        return self.sends.take_log()

    def kv_bytes_sent(self) -> int:
        """K + V payload bytes this rank has sent."""
        return self.sends.bytes_sent()

    def close(self) -> None:
        self.sends.close()

    # ---- leader: requests ---------------------------------------------------------------
    def handle(self, request: LeaderRequest) -> object:
        match request:
            case Prefill(spec, reservation):
                return self.prefill(spec, reservation)
            case Attach(request_id, reservation):
                return self.attach(request_id, reservation)
            case Abort(request_id):
                return self.abort(request_id)
        raise not_taken(self, self.cfg.name, request)

    def prefill(self, spec: RequestSpec, reservation: Reservation | None) -> None:
        """Queue a prompt for chunked prefill into ``reservation`` (None: computed now,
        shipped once :meth:`attach` brings it).

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
            ValueError: no reservation, on an instance that ships what only the step knows
                (DeepSeek-V4's staged rows, MTP's hidden state, context-parallel pieces).
        """
        if reservation is None and not self.attaches_late:
            raise ValueError(f"{self.cfg.name}: a prefill without a reservation needs "
                             "transfer of the whole KV after the step (no V4, MTP or cp > 1)")
        self.leader.check_in_service()  # NOTE: before the lock, which a step may hold
        with self.leader.lock:
            if self.leader.enqueue(spec) and reservation is not None:
                self.reservations[spec.request_id] = reservation

    @property
    def attaches_late(self) -> bool:
        """Whether a request may get its reservation after its compute (:meth:`attach`)."""
        return (self.staged_rows is None and self.cfg.parallel.cp == 1
                and not self.cfg.scheduler.num_speculative_tokens)

    def attach(self, request_id: str, reservation: Reservation) -> bool:
        """The reservation of a request queued without one: what it computed so far ships
        now (under the lock, so before any later chunk of it), the rest chunk by chunk.
        False when the request is gone (aborted, failed or given up).

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        leader = self.leader
        leader.check_in_service()
        with leader.lock:
            req = leader.scheduler.find(request_id)
            done = self.unattached.pop(request_id, None)
            if req is None and done is None:
                return False
            self.reservations[request_id] = reservation
            if done is not None:
                self.draining[request_id] = done.blocks
                blocks, end = done.blocks, done.end
            else:
                blocks, end = req.blocks, req.num_computed_tokens
                # NOTE: no chunk computed yet (not admitted, or admitted without budget): its
                # first chunk ships from the decode side's cached prefix on (chunk_transfers),
                # this instance's cached prefix included; shipping it here too would send it twice
                if blocks is None or end == req.num_cached_tokens:
                    return True
            late = late_transfer(request_id, blocks.block_ids, end, reservation,
                                 self.cfg.scheduler.block_size, last=done is not None)
            if late is not None:
                try:
                    leader.ranks.call_all(PrefillRole.send_late, late)
                except RankFailure as exc:
                    leader.mark_broken(str(exc))
                    raise leader.out_of_service() from exc
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns once no KV send into its reservation is in flight.

        Raises:
            TimeoutError: sends still in flight after ``payload_timeout_s`` (its blocks are
                freed once they are idle).
        """
        leader = self.leader
        # NOTE: read without the lock, which a step in progress holds: its forward's next
        # layers send nothing more of the request (layer by layer) once every rank knows
        early = self.reservations.get(request_id)
        if early is not None:
            self._abort_everywhere(request_id, early.peers)
        with leader.lock:
            res = self.reservations.pop(request_id, None)
            req = leader.scheduler.remove(request_id, free=False)
            blocks = req.blocks if req is not None else self.draining.pop(request_id, None)
            done = self.unattached.pop(request_id, None)
            if done is not None:
                blocks = done.blocks
            if res is None and blocks is None and req is None:
                leader.add_tombstone(request_id)
                return False
        idle = False
        try:
            if early is None and res is not None:  # NOTE: none: nothing was ever sent
                self._abort_everywhere(request_id, res.peers)
            idle = self._sends_idle_everywhere(request_id)
        finally:
            with leader.lock:
                if blocks is not None and idle:
                    leader.pool.free(blocks)
                elif blocks is not None:
                    self.draining[request_id] = blocks
        if not idle:
            raise TimeoutError(f"{self.cfg.name}: sends of {request_id} still in flight after "
                               f"{self.cfg.transfer.payload_timeout_s} s")
        return True

    # ---- leader: the loop ---------------------------------------------------------------
    def step(self) -> bool:
        leader = self.leader
        result = None
        if leader.agree_to_step():
            with leader.lock:
                result = leader.step(self._chunk_transfers)
                if result is not None:
                    for req in leader.finish_sampled(result.sampled, free=False):
                        self._computed(req)
                    for rid, error in result.failed.items():
                        self.fail(rid, error)
        aborted = self._send_kv_aborts()
        drained = self._free_drained()
        expired = self._expire_unattached()
        return result is not None or drained or aborted or expired

    def _computed(self, req) -> None:
        """Caller holds the lock: ``req``'s first token is out; its blocks stay until its
        sends are done, or, without a reservation yet, until one arrives."""
        rid = req.request_id
        if rid in self.reservations:
            self.draining[rid] = req.blocks
            return
        deadline = time.monotonic() + ORPHAN_FACTOR * self.cfg.transfer.completion_timeout_s
        self.unattached[rid] = Unattached(req.blocks, req.num_computed_tokens, deadline)

    def _expire_unattached(self) -> bool:
        """End (error event) and free the computed prompts whose reservation never came
        within their deadline; True when there were some."""
        if not self.unattached:  # NOTE: read without the lock: the loop adds them itself
            return False
        now, leader = time.monotonic(), self.leader
        with leader.lock:
            gone = [rid for rid, u in self.unattached.items() if u.deadline <= now]
            for rid in gone:
                leader.pool.free(self.unattached.pop(rid).blocks)
                leader.emit_end(rid, "error", f"{self.cfg.name}: no decode reservation came "
                                "for the computed prompt in time (its router is gone?)")
        return bool(gone)

    def _chunk_transfers(self, out: SchedulerOutput) -> list[ChunkTransfer]:
        """The step inputs of a prefill step: where each scheduled chunk's KV goes (V4: the
        staging rows each chunk makes final)."""
        if self.chunk_rows is not None:
            return staged_transfers(out, self.reservations, self.cfg.scheduler.block_size,
                                    self.chunk_rows)
        return chunk_transfers(out, self.reservations, self.cfg.scheduler.block_size)

    def fail(self, request_id: str, error: str, retryable: bool = False) -> None:
        """Caller holds the lock: error event; its sends are aborted after the lock, its
        blocks freed once every rank's sends of it are idle."""
        self.leader.emit_end(request_id, "error", error, retryable)
        req = self.leader.scheduler.remove(request_id, free=False)
        res = self.reservations.pop(request_id, None)
        if req is not None and req.blocks is not None:
            self.draining[request_id] = req.blocks
        if res is not None:
            self.kv_aborts.append((request_id, res.peers))

    def fail_all(self, error: str) -> None:
        self.leader.fail_scheduled(error, self.fail)
        with self.leader.lock:
            for rid in list(self.unattached):
                self.leader.emit_end(rid, "error", error, True)
                self.draining[rid] = self.unattached.pop(rid).blocks
        self._send_kv_aborts()
        try:
            self._free_drained()
        except RankFailure as exc:
            self.leader.mark_broken(str(exc))
        except Exception:  # noqa: BLE001 - retried on the next step
            log.exception("%s: freeing drained requests failed", self.cfg.name)

    def _send_kv_aborts(self) -> bool:
        """Abort the sends of the requests failed since the last call, on every rank (outside
        the lock); never raises. True when there were some."""
        with self.leader.lock:
            todo, self.kv_aborts = self.kv_aborts, []
        for rid, peers in todo:
            self._abort_everywhere(rid, peers)
        return bool(todo)

    def _abort_everywhere(self, request_id: str, peers: tuple[KVPeer, ...]) -> None:
        """Cancel the request's sends on every rank (only on this one once out of service);
        never raises (a dead or hung rank takes the instance out of service)."""
        try:
            if self.leader.broken is None:
                self.leader.ranks.call_all(PrefillRole.abort_kv, request_id, peers)
                return
        except RankFailure as exc:
            self.leader.mark_broken(str(exc))
        except Exception:  # noqa: BLE001 - its blocks still wait for idle sends
            log.exception("%s: aborting the sends of %s failed", self.cfg.name, request_id)
            return
        try:
            self.abort_kv(request_id, peers)
        except Exception:  # noqa: BLE001
            log.exception("%s: aborting the sends of %s failed", self.cfg.name, request_id)

    def _free_drained(self) -> bool:
        """Free the blocks of requests whose sends finished on every rank (all of them once
        out of service: nothing reuses the blocks). Asks the ranks outside the lock.

        Raises:
            RankFailure: a rank is dead or hung.
        """
        leader = self.leader
        with leader.lock:
            rids = list(self.draining)
        if not rids:
            return False
        if leader.broken is None:
            idle = leader.ranks.call_all(PrefillRole.sends_idle, rids)
            rids = [rid for rid in rids if all(rank[rid] for rank in idle)]
        with leader.lock:
            for rid in rids:
                blocks = self.draining.pop(rid, None)  # NOTE: whoever pops it frees it
                if blocks is not None:
                    leader.pool.free(blocks)
                self.reservations.pop(rid, None)
        return bool(rids)

    def _sends_idle_everywhere(self, request_id: str) -> bool:
        """Wait (``payload_timeout_s``) until no rank sends ``request_id``; True once out of
        service (nothing reuses the blocks)."""
        if self.leader.broken is None:
            try:
                wait_s = self.cfg.transfer.payload_timeout_s
                idle = self.leader.ranks.call_all(
                    PrefillRole.sends_idle, [request_id], wait_s,
                    timeout_s=wait_s + self.cfg.parallel.step_timeout_s)
                return all(rank[request_id] for rank in idle)
            except RankFailure as exc:
                self.leader.mark_broken(str(exc))
        return True

    # ---- leader: status -----------------------------------------------------------------
    def num_active(self) -> int:
        return self.leader.num_scheduled() + len(self.draining) + len(self.unattached)

    def status_fields(self, timeout_s: float | None) -> dict:
        if timeout_s is None:
            logs, sent = [self.take_transfer_log()], [self.kv_bytes_sent()]
        else:
            ranks = self.leader.ranks
            logs = ranks.call_all(PrefillRole.take_transfer_log, timeout_s=timeout_s)
            sent = ranks.call_all(PrefillRole.kv_bytes_sent, timeout_s=timeout_s)
        return {"kv_bytes_sent": sum(sent),
                "transfers": tuple(record for rank in logs for record in rank)}

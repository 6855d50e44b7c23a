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

from engine.block_pool import BlockSet
from engine.request import RequestSpec
from engine.scheduler import PREFILL, SchedulerOutput
from kv_transfer import KVPeer
from prefill_worker.kv_sends import (ChunkTransfer, KVSends, LayerSends, chunk_transfers,
                                     staged_transfers)
from rank.failures import RankFailure
from rank.messages import Abort, LeaderRequest, Prefill, Reservation, TransferRecord
from rank.role import RankParts, Role, not_taken

log = logging.getLogger(__name__)


class PrefillRole(Role):
    """Role of a prefill instance. Requests: ``Prefill``, ``Abort``. Rank-to-rank calls
    (every rank): :meth:`sends_idle`, :meth:`abort_kv`, :meth:`take_transfer_log`,
    :meth:`kv_bytes_sent`."""

    policy = PREFILL
    source = "prefill"

    def __init__(self, parts: RankParts) -> None:
        self.cfg = parts.cfg
        self.sends = KVSends(parts.runner, parts.cfg, parts.rank)
        self.leader = parts.leader
        self.staged_rows = getattr(parts.runner, "staged_rows", None)  # DeepSeek-V4
        # leader: the request tables (under the leader's lock)
        self.reservations: dict[str, Reservation] = {}
        self.draining: dict[str, BlockSet] = {}  # first token out, sends still running
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
            case Abort(request_id):
                return self.abort(request_id)
        raise not_taken(self, self.cfg.name, request)

    def prefill(self, spec: RequestSpec, reservation: Reservation) -> None:
        """Queue a prompt for chunked prefill into ``reservation``.

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        self.leader.check_in_service()  # NOTE: before the lock, which a step may hold
        with self.leader.lock:
            if self.leader.enqueue(spec):
                self.reservations[spec.request_id] = reservation

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
            if res is None and blocks is None:
                leader.add_tombstone(request_id)
                return False
        idle = False
        try:
            if early is None:
                self._abort_everywhere(request_id, res.peers if res is not None else ())
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
                        self.draining[req.request_id] = req.blocks
                    for rid, error in result.failed.items():
                        self.fail(rid, error)
        aborted = self._send_kv_aborts()
        drained = self._free_drained()
        return result is not None or drained or aborted

    def _chunk_transfers(self, out: SchedulerOutput) -> list[ChunkTransfer]:
        """The step inputs of a prefill step: where each scheduled chunk's KV goes (V4: the
        staging rows of each completed prompt)."""
        if self.staged_rows is not None:
            return staged_transfers(out, self.reservations, self.cfg.scheduler.block_size,
                                    self.staged_rows)
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
        return self.leader.num_scheduled() + len(self.draining)

    def status_fields(self, timeout_s: float | None) -> dict:
        if timeout_s is None:
            logs, sent = [self.take_transfer_log()], [self.kv_bytes_sent()]
        else:
            ranks = self.leader.ranks
            logs = ranks.call_all(PrefillRole.take_transfer_log, timeout_s=timeout_s)
            sent = ranks.call_all(PrefillRole.kv_bytes_sent, timeout_s=timeout_s)
        return {"kv_bytes_sent": sum(sent),
                "transfers": tuple(record for rank in logs for record in rank)}

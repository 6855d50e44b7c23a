"""Prefill rank actor: chunked prefill into a decode reservation, KV sent chunk by chunk.

Protocol (DESIGN.md "One request"), prefill side:

1. ``prefill(spec, reservation)``: queue the request; blocks for its prompt are taken on this
   instance when the scheduler admits it.
2. Each step computes a chunk of each running prompt on every rank; right after the model
   step, every rank queues its planned layers of those tokens to its decode peers
   (asynchronous: the next chunk computes while the bytes move).
3. The step that completes the prompt samples the first token (TTFT), which goes straight to
   the router; every rank sends its completion records; the request leaves the scheduler but
   its blocks stay until every rank's sends for it are done ("draining"), then are freed once.

Abort: the request leaves the queue; every rank cancels its queued sends and says so to the
decode side; ``abort`` returns only when no send into the reservation is still in flight.
A request that fails (its chunk or its sampling, see rank/leader.py) ends the same
way, from the loop: error event, sends aborted on every rank, blocks freed once idle.

Out of service (a rank dead or hung): every request ends with an error event, the leader's own
sends are aborted (the decode side learns at once) and the blocks are freed without asking
the other ranks (nothing reuses them: new work is refused).

Rank calls (``abort_kv``, ``sends_idle``) never run under the leader lock.
"""

from __future__ import annotations

from dataclasses import dataclass

import logging

from engine.block_pool import BlockSet, slot_mapping
from engine.scheduler import PREFILL, SchedulerOutput
from kv_transfer import KVPeer, KVPoll
from rank.messages import Reservation, TokenEvent
from engine.request import RequestSpec
from prefill_worker.transfer_log import TransferLog
from rank.kv_setup import make_layout
from rank.leader import LeaderRank
from rank.failures import RankFailure

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkTransfer:
    """KV of tokens ``[start, end)`` of one request, to go to its decode reservation.

    Attributes:
        request_id: the request.
        peers: the decode ranks (from the reservation).
        start, end: token positions.
        src_slots: int64 ``[end - start]`` slots in this instance's cache.
        dst_slots: int64 ``[end - start]`` slots in the decode instance's cache.
        last: the chunk completes the prompt: send completion records after it.
    """

    request_id: str
    peers: tuple[KVPeer, ...]
    start: int
    end: int
    src_slots: object
    dst_slots: object
    last: bool


class PrefillRank(LeaderRank):
    """Rank actor of a prefill instance. Leader methods: ``prefill``, ``abort``, ``poll``,
    ``status``, ``drain``, ``shutdown``; every rank: ``sends_idle``, ``abort_kv``."""

    policy = PREFILL
    source = "prefill"

    def setup_role(self) -> None:
        from kv_transfer import PrefillKVConnector

        self.connector = PrefillKVConnector(
            self.runner.kv_cache, make_layout(self.runner, self.cfg), self.cfg.name, self.rank,
            self.cfg.parallel.tp, self.cfg.transfer, cp=self.cfg.parallel.cp)
        self.transfer_log = TransferLog()
        if self.rank == 0:
            self.setup_leader()
            self.reservations: dict[str, Reservation] = {}
            self.draining: dict[str, BlockSet] = {}  # first token out, sends still running
            # failed requests whose sends every rank still has to abort (outside the lock)
            self.kv_aborts: list[tuple[str, tuple[KVPeer, ...]]] = []

    # ---- every rank ---------------------------------------------------------------------
    def after_step(self, step_inputs: list[ChunkTransfer] | None) -> None:
        """Queue this rank's planned layers of each chunk to its decode peers; completion
        records after a request's last chunk."""
        spec = self.runner.kv_spec
        for t in step_inputs or ():
            self.connector.send_chunk(t.request_id, t.peers, t.start, t.end, t.src_slots,
                                      t.dst_slots)
            plan = self.connector.plan(len(t.peers))
            tokens = sum(b - a for a, b in plan.token_ranges(self.rank, t.start, t.end))
            for send in plan.sends_from(self.rank):
                pair = f"{self.cfg.name}:{self.rank}->{t.peers[send.decode_rank].instance}:" \
                       f"{send.decode_rank}"
                self.transfer_log.add(t.request_id, pair,
                                      spec.bytes_per_token_of(send.layers) * tokens)
            if t.last:
                self.connector.finish(t.request_id, t.peers, t.end)

    def sends_idle(self, request_ids: list[str], timeout_s: float = 0.0) -> dict[str, bool]:
        """request id -> True when no send of it is queued or in flight on this rank (waits
        up to ``timeout_s`` for each); an idle request's transfer record is closed."""
        out = {}
        for rid in request_ids:
            status = self.connector.wait(rid, timeout_s)
            out[rid] = not status.busy
            if not status.busy:
                self.transfer_log.close(rid, ok=status.state is not KVPoll.FAILED)
        return out

    def take_transfer_log(self) -> tuple:
        """This rank's closed per-pair transfer records since the last call."""
        return self.transfer_log.take()

    def abort_kv(self, request_id: str, peers: tuple[KVPeer, ...]) -> None:
        self.connector.abort(request_id, peers)

    def kv_bytes_sent(self) -> int:
        """K + V payload bytes this rank has sent."""
        return self.connector.stats.snapshot()["bytes"]

    def close_role(self) -> None:
        self.connector.close()

    # ---- leader -------------------------------------------------------------------------
    def prefill(self, spec: RequestSpec, reservation: Reservation) -> None:
        """Queue a prompt for chunked prefill into ``reservation``.

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        self.check_in_service()  # NOTE: before the lock, which a step may hold
        with self._lock:
            if self.enqueue(spec):
                self.reservations[spec.request_id] = reservation

    def _chunk_transfers(self, out: SchedulerOutput) -> list[ChunkTransfer]:
        """The step inputs of a prefill step: where each scheduled chunk's KV goes."""
        bs = self.cfg.scheduler.block_size
        plans = []
        for c in out.chunks:
            res = self.reservations[c.request.request_id]
            plans.append(ChunkTransfer(
                c.request.request_id, res.peers, c.start, c.end,
                slot_mapping(c.request.blocks.block_ids, c.start, c.end, bs),
                slot_mapping(res.block_ids, c.start, c.end, res.block_size), c.completes))
        return plans

    def step(self) -> bool:
        result = None
        if self.agree_to_step():
            with self._lock:
                result = self.leader_step(self._chunk_transfers)
                if result is not None:
                    for req in self.finish_sampled(result.sampled, free=False):
                        self.draining[req.request_id] = req.blocks
                    self.fail_requests(result.failed)
        aborted = self._send_kv_aborts()
        drained = self._free_drained()
        return result is not None or drained or aborted

    def fail_request(self, request_id: str, error: str, retryable: bool = False) -> None:
        """Caller holds the lock: error event; its sends are aborted after the lock, its
        blocks freed once every rank's sends of it are idle."""
        self.emit(TokenEvent(request_id, (), "error", error, self.source, self.cfg.name,
                             retryable=retryable))
        req = self.scheduler.remove(request_id, free=False)
        res = self.reservations.pop(request_id, None)
        if req is not None and req.blocks is not None:
            self.draining[request_id] = req.blocks
        if res is not None:
            self.kv_aborts.append((request_id, res.peers))

    def fail_all(self, error: str) -> None:
        """End every queued or running request with an error; never raises."""
        super().fail_all(error)
        self._send_kv_aborts()
        try:
            self._free_drained()
        except RankFailure as exc:
            self.mark_broken(str(exc))
        except Exception:  # noqa: BLE001 - retried on the next step
            log.exception("%s: freeing drained requests failed", self.cfg.name)

    def _send_kv_aborts(self) -> bool:
        """Abort the sends of the requests failed since the last call, on every rank (outside
        the lock); never raises. True when there were some."""
        with self._lock:
            todo, self.kv_aborts = self.kv_aborts, []
        for rid, peers in todo:
            self._abort_everywhere(rid, peers)
        return bool(todo)

    def _abort_everywhere(self, request_id: str, peers: tuple[KVPeer, ...]) -> None:
        """Cancel the request's sends on every rank (only on this one once out of service);
        never raises (a dead or hung rank takes the instance out of service)."""
        try:
            if self.broken is None:
                self.call_all("abort_kv", request_id, peers)
                return
        except RankFailure as exc:
            self.mark_broken(str(exc))
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
        with self._lock:
            rids = list(self.draining)
        if not rids:
            return False
        if self.broken is None:
            idle = self.call_all("sends_idle", rids)
            rids = [rid for rid in rids if all(rank[rid] for rank in idle)]
        with self._lock:
            for rid in rids:
                blocks = self.draining.pop(rid, None)  # NOTE: whoever pops it frees it
                if blocks is not None:
                    self.pool.free(blocks)
                self.reservations.pop(rid, None)
        return bool(rids)

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns once no KV send into its reservation is in flight.

        Raises:
            TimeoutError: sends still in flight after ``payload_timeout_s`` (its blocks are
                freed once they are idle).
        """
        with self._lock:
            res = self.reservations.pop(request_id, None)
            req = self.scheduler.remove(request_id, free=False)
            blocks = req.blocks if req is not None else self.draining.pop(request_id, None)
            if res is None and blocks is None:
                self.add_tombstone(request_id)
                return False
        idle = False
        try:
            self._abort_everywhere(request_id, res.peers if res is not None else ())
            idle = self._sends_idle_everywhere(request_id)
        finally:
            with self._lock:
                if blocks is not None and idle:
                    self.pool.free(blocks)
                elif blocks is not None:
                    self.draining[request_id] = blocks
        if not idle:
            raise TimeoutError(f"{self.cfg.name}: sends of {request_id} still in flight after "
                               f"{self.cfg.transfer.payload_timeout_s} s")
        return True

    def _sends_idle_everywhere(self, request_id: str) -> bool:
        """Wait (``payload_timeout_s``) until no rank sends ``request_id``; True once out of
        service (nothing reuses the blocks)."""
        if self.broken is None:
            try:
                wait_s = self.cfg.transfer.payload_timeout_s
                idle = self.call_all("sends_idle", [request_id], wait_s,
                                     timeout_s=wait_s + self.cfg.parallel.step_timeout_s)
                return all(rank[request_id] for rank in idle)
            except RankFailure as exc:
                self.mark_broken(str(exc))
        return True

    def num_active(self) -> int:
        return super().num_active() + len(self.draining)

    def transfer_stats(self, timeout_s: float | None) -> dict:
        if timeout_s is None:
            logs, sent = [self.take_transfer_log()], [self.kv_bytes_sent()]
        else:
            logs = self.call_all("take_transfer_log", timeout_s=timeout_s)
            sent = self.call_all("kv_bytes_sent", timeout_s=timeout_s)
        records = [r for rank in logs for r in rank]
        return {"kv_bytes_sent": sum(sent),
                "transfers": tuple((r.pair, r.nbytes, r.seconds, r.ok) for r in records)}

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
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockSet, slot_mapping
from engine.scheduler import PREFILL, SchedulerOutput
from kv_transfer import KVPeer
from prefill_worker.messages import Reservation, RequestSpec, TokenEvent
from prefill_worker.transfer_log import TransferLog
from prefill_worker.kv_setup import make_layout
from prefill_worker.leader import LeaderRank


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
            self.cfg.parallel.tp, self.cfg.transfer)
        self.transfer_log = TransferLog()
        if self.rank == 0:
            self.setup_leader()
            self.reservations: dict[str, Reservation] = {}
            self.draining: dict[str, BlockSet] = {}  # first token out, sends still running

    # ---- every rank ---------------------------------------------------------------------
    def after_step(self, step_inputs: list[ChunkTransfer] | None) -> None:
        """Queue this rank's planned layers of each chunk to its decode peers; completion
        records after a request's last chunk."""
        per_token_layer = self.runner.kv_spec.bytes_per_token_per_layer
        for t in step_inputs or ():
            self.connector.send_chunk(t.request_id, t.peers, t.start, t.end, t.src_slots,
                                      t.dst_slots)
            for send in self.connector.plan(len(t.peers)).sends_from(self.rank):
                pair = f"{self.cfg.name}:{self.rank}->{t.peers[send.decode_rank].instance}:" \
                       f"{send.decode_rank}"
                self.transfer_log.add(t.request_id, pair,
                                      len(send.layers) * (t.end - t.start) * per_token_layer)
            if t.last:
                self.connector.finish(t.request_id, t.peers, t.end)

    def sends_idle(self, request_ids: list[str], timeout_s: float = 0.0) -> dict[str, bool]:
        """request id -> True when no send of it is queued or in flight on this rank (waits
        up to ``timeout_s`` for each); an idle request's transfer record is closed."""
        from kv_transfer import TransferTimeout

        out = {}
        for rid in request_ids:
            try:
                self.connector.wait_idle(rid, timeout_s)
                out[rid] = True
                self.transfer_log.close(rid, ok=self.connector.failure(rid) is None)
            except TransferTimeout:
                out[rid] = False
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
        """Queue a prompt for chunked prefill into ``reservation``."""
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
        with self._lock:
            result = self.leader_step(self._chunk_transfers)
            if result is not None:
                for req in self.finish_sampled(result.sampled, free=False):
                    self.draining[req.request_id] = req.blocks
            drained = self._free_drained()
        return result is not None or drained

    def _free_drained(self) -> bool:
        """Free the blocks of requests whose sends finished on every rank."""
        if not self.draining:
            return False
        idle = self.call_all("sends_idle", list(self.draining))
        done = [rid for rid in list(self.draining) if all(rank[rid] for rank in idle)]
        for rid in done:
            self.pool.free(self.draining.pop(rid))
            self.reservations.pop(rid, None)
        return bool(done)

    def abort(self, request_id: str) -> bool:
        """Stop a request; returns once no KV send into its reservation is in flight."""
        with self._lock:
            res = self.reservations.pop(request_id, None)
            req = self.scheduler.remove(request_id, free=False)
            blocks = req.blocks if req is not None else self.draining.pop(request_id, None)
            if res is None and blocks is None:
                self.add_tombstone(request_id)
                return False
            peers = res.peers if res is not None else ()
            self.call_all("abort_kv", request_id, peers)
            idle = self.call_all("sends_idle", [request_id], self.cfg.transfer.payload_timeout_s)
            if blocks is not None:
                self.pool.free(blocks)
        if not all(rank[request_id] for rank in idle):
            raise TimeoutError(f"{self.cfg.name}: sends of {request_id} still in flight after "
                               f"{self.cfg.transfer.payload_timeout_s} s")
        return True

    def num_active(self) -> int:
        return super().num_active() + len(self.draining)

    def fail_all(self, error: str) -> None:
        """End every queued or running request with an error; cancel its sends first."""
        for req in [*self.scheduler.running, *self.scheduler.waiting]:
            try:
                self.abort(req.request_id)
            finally:
                self.emit(TokenEvent(req.request_id, (), "error", error, self.source,
                                     self.cfg.name))

    def transfer_stats(self) -> dict:
        records = [r for rank in self.call_all("take_transfer_log") for r in rank]
        return {"kv_bytes_sent": sum(self.call_all("kv_bytes_sent")),
                "transfers": tuple((r.pair, r.nbytes, r.seconds, r.ok) for r in records)}

"""Decode rank actor: reservations, KV receive, continuous-batching decode.

Protocol (DESIGN.md "One request"), decode side:

1. ``reserve(spec, prefill_tp, prefill_cp)``: take blocks for prompt + max_tokens BEFORE
   prefill computes and tell every rank's KV receiver to expect the prompt's KV; or a
   :class:`Rejection`.
2. KV arrives on the receiver threads of every rank, straight into the reserved slots.
3. ``admit(request_id, first_token_id)``: prefill's first token; it returns at once (it never
   waits for a step in progress) and the loop applies it before its next step; once every
   rank has every layer, the request joins the running batch with
   ``num_computed_tokens = prompt``.
4. Tokens stream out through ``poll``; at the end the blocks are freed exactly once.

Abort/failure: the receivers forget the request first (payloads for unknown requests are
dropped, never written), then the blocks are freed. Out of service (a rank dead or hung):
every request ends with an error event and only the leader's receiver is told (nothing
reuses the blocks: ``reserve`` and ``admit`` are refused).
"""

from __future__ import annotations

import logging
import queue
import time

from decode_worker.request_state import DecodeRequestState, ReservedRequest
from engine.scheduler import DECODE
from engine.request import Request
from kv_transfer import KVPeer, KVPoll, KVStatus
from rank.kv_setup import make_layout, stretch_completion
from rank.leader import LeaderRank
from rank.messages import Rejection, Reservation, TokenEvent
from engine.request import RequestSpec
from rank.failures import RankFailure

log = logging.getLogger(__name__)

# NOTE: a reservation never admitted (router gone) is freed after this many completion timeouts.
ORPHAN_FACTOR = 4


class DecodeRank(LeaderRank):
    """Rank actor of a decode instance. Leader methods: ``reserve``, ``admit``, ``abort``,
    ``poll``, ``status``, ``drain``, ``shutdown``; every rank: ``kv_peer``, ``expect_kv``,
    ``kv_status``, ``release_kv``."""

    policy = DECODE
    source = "decode"

    def setup_role(self) -> None:
        from kv_transfer import DecodeKVConnector

        self.connector = DecodeKVConnector(
            self.runner.kv_cache, make_layout(self.runner, self.cfg), self.cfg.name, self.rank,
            stretch_completion(self.cfg.transfer, ORPHAN_FACTOR),
            host=self.cfg.parallel.bind_host)
        if self.rank == 0:
            self.setup_leader()
            self.reserved: dict[str, ReservedRequest] = {}  # holds blocks, not in the batch yet
            # (request id, first token, completion deadline) admitted, not yet applied
            self.first_tokens: queue.SimpleQueue[tuple[str, int, float]] = queue.SimpleQueue()
            self.peers_kv: tuple[KVPeer, ...] = ()
            self.kv_failures = 0  # requests failed for missing or broken KV

    # ---- every rank ---------------------------------------------------------------------
    def kv_peer(self) -> KVPeer:
        host, port = self.connector.address
        return KVPeer(self.cfg.name, self.rank, host, port)

    def expect_kv(self, request_id: str, num_tokens: int, prefill_tp: int,
                  prefill_cp: int = 1) -> None:
        self.connector.expect(request_id, num_tokens, prefill_tp, prefill_cp)

    def kv_status(self, request_ids: list[str]) -> dict[str, KVStatus]:
        """request id -> this rank's :class:`KVStatus` of its prompt KV. A request this rank
        does not expect (released meanwhile) reads as FAILED."""
        return {rid: self.connector.poll(rid) for rid in request_ids}

    def release_kv(self, request_id: str) -> None:
        self.connector.release(request_id)

    def close_role(self) -> None:
        self.connector.close()

    # ---- leader -------------------------------------------------------------------------
    def start(self) -> None:
        self.peers_kv = tuple(self.call_all("kv_peer"))
        super().start()

    def reserve(self, spec: RequestSpec, prefill_tp: int = 1,
                prefill_cp: int = 1) -> Reservation | Rejection:
        """Take blocks for prompt + max_tokens and arm every rank's receiver for a prefill
        instance of ``prefill_cp`` x ``prefill_tp`` ranks (the transfer plan's sizes).

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        self.check_in_service()  # NOTE: before the lock, which a step may hold
        with self._lock:
            self.check_in_service()
            need = self.scheduler.blocks_for(spec)
            reason = self.too_big(need)
            if reason is not None:
                return Rejection(spec.request_id, reason, retryable=False)
            if self.has_tombstone(spec.request_id):
                return Rejection(spec.request_id, f"request {spec.request_id!r} was aborted "
                                 "before its reservation", retryable=False)
            if spec.request_id in self.reserved or self.scheduler.find(spec.request_id):
                return Rejection(spec.request_id, f"request id {spec.request_id!r} is already "
                                 f"on {self.cfg.name}: use a fresh id", retryable=False)
            if not self.pool.can_allocate(need):
                return Rejection(spec.request_id, f"{self.cfg.name} is full "
                                 f"({self.pool.num_free_blocks} of {self.pool.num_blocks} "
                                 f"blocks free, {need} needed)", retryable=True)
            blocks = self.pool.allocate(need)
            self.reserved[spec.request_id] = ReservedRequest(
                Request(spec, blocks=blocks), DecodeRequestState.WAITING_FOR_FIRST_TOKEN,
                deadline=time.monotonic() + ORPHAN_FACTOR * self.cfg.transfer.completion_timeout_s)
        try:
            self.call_all("expect_kv", spec.request_id, spec.num_prompt_tokens, prefill_tp,
                          prefill_cp)
        except RankFailure as exc:
            self.mark_broken(str(exc))
            self._drop_reserved(spec.request_id)
            raise self.out_of_service() from exc
        except Exception:
            self._drop_reserved(spec.request_id)
            raise
        return Reservation(spec.request_id, self.cfg.name, blocks.block_ids,
                           self.cfg.scheduler.block_size, self.peers_kv)

    def admit(self, request_id: str, first_token_id: int) -> None:
        """Prefill's first token arrived; the request runs once its KV is complete, or fails
        ``completion_timeout_s`` from now. Returns at once: it never takes the lock a step in
        progress holds (the loop applies it before its next step, :meth:`_apply_first_tokens`).

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        self.check_in_service()
        deadline = time.monotonic() + self.cfg.transfer.completion_timeout_s
        self.first_tokens.put((request_id, first_token_id, deadline))
        self._wake.set()

    def _apply_first_tokens(self) -> None:
        """Loop: each admitted reservation now waits for its KV (one aborted meanwhile is
        gone: its first token is dropped)."""
        while True:
            try:
                request_id, token, deadline = self.first_tokens.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                entry = self.reserved.get(request_id)
                if entry is not None:
                    entry.request.output_token_ids = [token]
                    entry.state = DecodeRequestState.WAITING_FOR_KV
                    entry.deadline = deadline

    def _drop_reserved(self, request_id: str) -> Request | None:
        """Forget a reserved request on every rank, then free its blocks (in that order);
        never raises."""
        with self._lock:
            entry = self.reserved.pop(request_id, None)
        if entry is None:
            return None
        try:
            self._release_everywhere(request_id)
        finally:
            with self._lock:
                self.pool.free(entry.request.blocks)
        return entry.request

    def _release_everywhere(self, request_id: str) -> None:
        """Every rank's receiver forgets the request (only this rank's once out of service:
        nothing reuses the blocks); never raises."""
        try:
            if self.broken is None:
                self.call_all("release_kv", request_id)
                return
        except RankFailure as exc:
            self.mark_broken(str(exc))
        except Exception:  # noqa: BLE001 - a live rank that raised: logged, blocks freed
            log.exception("%s: releasing the KV of %s failed", self.cfg.name, request_id)
            return
        try:
            self.release_kv(request_id)
        except Exception:  # noqa: BLE001
            log.exception("%s: releasing the KV of %s failed", self.cfg.name, request_id)

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; blocks freed once receivers dropped it."""
        with self._lock:
            if request_id not in self.reserved and self.scheduler.find(request_id) is None:
                self.add_tombstone(request_id)  # a reserve still on its way is refused
                return False
        if self._drop_reserved(request_id) is not None:
            found = True
        else:
            with self._lock:
                found = self.scheduler.remove(request_id) is not None
        if found:
            self.emit(TokenEvent(request_id, (), "abort", source=self.source,
                                 instance=self.cfg.name))
        return found

    def _settle_reserved(self) -> bool:
        """Ask every rank about the KV of each request waiting for KV or past its deadline,
        and settle each; True when one joined the batch or failed."""
        now = time.monotonic()
        with self._lock:
            rids = [rid for rid, entry in self.reserved.items()
                    if entry.state is DecodeRequestState.WAITING_FOR_KV or now > entry.deadline]
        if not rids:
            return False
        statuses = self.call_all("kv_status", rids)
        settled = [self._settle(rid, [s[rid] for s in statuses], now) for rid in rids]
        return any(settled)

    def _settle(self, request_id: str, per_rank: list[KVStatus], now: float) -> bool:
        """Move one reserved request into the batch (KV complete on every rank, first token
        admitted), or fail it (a rank failed, or past its deadline); True unless it waits on."""
        with self._lock:
            entry = self.reserved.get(request_id)
        if entry is None:  # aborted meanwhile (and freed there)
            return True
        errors = [s.error for s in per_rank if s.state is KVPoll.FAILED]
        complete = all(s.state is KVPoll.SUCCESS for s in per_rank)
        if complete and entry.state is DecodeRequestState.WAITING_FOR_KV:
            self._join_batch(request_id)
        elif errors or now > entry.deadline:
            self._fail_reserved(request_id, errors[0] if errors else self._deadline_error(entry),
                                kv_failed=bool(errors) or not complete)
        else:
            return False
        return True

    def _deadline_error(self, entry: ReservedRequest) -> str:
        """Why ``entry`` failed at its deadline."""
        timeout = self.cfg.transfer.completion_timeout_s
        if entry.state is DecodeRequestState.WAITING_FOR_KV:
            return (f"KV for the prompt did not reach every rank of {self.cfg.name} within "
                    f"{timeout} s of the first token")
        return (f"{self.cfg.name}: no first token was admitted within "
                f"{ORPHAN_FACTOR * timeout} s of the reservation (router gone?); its blocks "
                "are freed")

    def _join_batch(self, request_id: str) -> None:
        """Hand a request whose KV is complete to the scheduler (its KV counts as computed)."""
        self.call_all("release_kv", request_id)
        with self._lock:
            entry = self.reserved.pop(request_id, None)
            if entry is not None:  # else aborted meanwhile (and freed there)
                entry.request.num_computed_tokens = entry.request.num_prompt_tokens
                self.scheduler.add(entry.request)

    def _fail_reserved(self, request_id: str, error: str, kv_failed: bool) -> None:
        """End a reserved request with ``error`` and free its blocks; ``kv_failed``: its KV
        broke or was missing (counted in ``kv_failures``). Never the request's own fault, so
        the event is retryable (the router places it again while no token was streamed)."""
        if self._drop_reserved(request_id) is not None:
            if kv_failed:
                self.kv_failures += 1
            self.emit(TokenEvent(request_id, (), "error", error, self.source, self.cfg.name,
                                 retryable=True))

    def step(self) -> bool:
        self._apply_first_tokens()
        settled = self._settle_reserved()
        if not self.agree_to_step():
            return settled
        with self._lock:
            result = self.leader_step()
            if result is not None:
                self.finish_sampled(result.sampled)
                self.fail_requests(result.failed)
        return result is not None or settled

    def num_active(self) -> int:
        return super().num_active() + len(self.reserved)

    def transfer_stats(self, timeout_s: float | None) -> dict:
        return {"kv_failures": self.kv_failures}

    def fail_all(self, error: str) -> None:
        """End every request, reserved ones included, with ``error``; never raises."""
        super().fail_all(error)
        with self._lock:
            rids = list(self.reserved)
        for rid in rids:
            try:
                self._fail_reserved(rid, error, kv_failed=False)
            except Exception:  # noqa: BLE001 - the others still get their event
                log.exception("%s: failing %s failed", self.cfg.name, rid)

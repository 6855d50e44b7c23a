"""Decode role: reservations, KV receive, continuous-batching decode.

Protocol (DESIGN.md "One request"), decode side:

1. :class:`~rank.messages.Reserve` ``(spec, prefill_tp, prefill_cp)``: take blocks for
   prompt + max_tokens BEFORE prefill computes and tell every rank's KV receiver to expect the
   prompt's KV; or a :class:`~rank.messages.Rejection`. With the prefix cache the reservation
   reuses the cached blocks of the prompt's longest cached prefix (a conversation's earlier
   turn: finished requests' prompt and output blocks stay cached) and says how many leading
   tokens it holds (``Reservation.num_cached_tokens``): only the rest is expected and shipped.
2. KV arrives on the receiver threads of every rank, straight into the reserved slots.
3. :class:`~rank.messages.Admit` ``(request_id, first_token_id)``: prefill's first token; it
   returns at once (it never waits for a step in progress) and the loop applies it before its
   next step; once every rank has every layer, the request joins the running batch with
   ``num_computed_tokens = prompt``.
4. Tokens stream out on the leader's event stream; at the end the blocks are freed exactly once.

DeepSeek-V4 (a runner with ``admit_staged``; :mod:`decode_worker.v4_staged`): the reservation
takes the slots of ``staged_rows(prompt)`` rows (the request's state, staged by prefill chunk
by chunk; the receivers expect each layer's own row count there, ``layer_rows``) and commits
the most blocks per V4 KV group the request will hold (:mod:`engine.v4.admission`; one that
does not fit now is refused, retryable); joining the batch rebuilds the request's V4 cache
from them on every rank first (a rebuild that fails fails the request, its blocks freed once).

Abort/failure: the receivers forget the request first (payloads for unknown requests are
dropped, never written), then the blocks are freed. Out of service (a rank dead or hung):
every request ends with an error event and only the leader's receiver is told (nothing
reuses the blocks: ``Reserve`` and ``Admit`` are refused).
"""

from __future__ import annotations

import logging
import queue
import time

import torch

from decode_worker.request_state import DecodeRequestState, ReservedRequest
from decode_worker.v4_staged import V4Staged
from engine.request import Request, RequestSpec
from engine.scheduler import DECODE
from engine.spec_decode import DraftInput
from kv_transfer import DecodeKVConnector, KVPeer, KVPoll, KVStatus
from rank.failures import RankFailure
from rank.kv_setup import make_layout, stretch_completion
from rank.messages import (Abort, Admit, KVTailStats, LeaderRequest, Rejection, Reservation,
                           Reserve)
from rank.role import RankParts, Role, not_taken

log = logging.getLogger(__name__)

# NOTE: a reservation never admitted (router gone) is freed after this many completion timeouts.
ORPHAN_FACTOR = 4


class DecodeRole(V4Staged, Role):
    """Role of a decode instance. Requests: ``Reserve``, ``Admit``, ``Abort``. Rank-to-rank
    calls (every rank): :meth:`kv_peer`, :meth:`expect_kv`, :meth:`kv_status`,
    :meth:`release_kv`."""

    policy = DECODE
    source = "decode"

    def __init__(self, parts: RankParts) -> None:
        self.cfg, self.rank, self.leader = parts.cfg, parts.rank, parts.leader
        self.connector = DecodeKVConnector(
            parts.runner.kv_cache, make_layout(parts.runner, self.cfg), self.cfg.name,
            self.rank, stretch_completion(self.cfg.transfer, ORPHAN_FACTOR),
            host=self.cfg.parallel.bind_host)
        self.device, self.hidden_size = parts.runner.device, \
            parts.runner.model_config.hidden_size
        self.runner = parts.runner
        self.staged_rows = getattr(parts.runner, "staged_rows", None)  # DeepSeek-V4
        # leader: holds blocks, not in the batch yet (under the leader's lock)
        self.reserved: dict[str, ReservedRequest] = {}
        # (request id, first token, completion deadline) admitted, not yet applied
        self.first_tokens: queue.SimpleQueue[tuple[str, int, float]] = queue.SimpleQueue()
        self.peers_kv: tuple[KVPeer, ...] = ()
        self.kv_failures = 0  # requests failed for missing or broken KV
        self.kv_tail = KVTailStats()  # leader: kv_tail_s of the requests that joined the batch

    # ---- every rank ---------------------------------------------------------------------
    def kv_peer(self) -> KVPeer:
        host, port = self.connector.address
        return KVPeer(self.cfg.name, self.rank, host, port)

    def expect_kv(self, request_id: str, num_tokens: int, prefill_tp: int,
                  prefill_cp: int = 1, first_token: int = 0,
                  layer_tokens: tuple[int, ...] | None = None) -> None:
        self.connector.expect(request_id, num_tokens, prefill_tp, prefill_cp, first_token,
                              layer_tokens)

    def kv_status(self, request_ids: list[str]) -> dict[str, KVStatus]:
        """request id -> this rank's :class:`KVStatus` of its prompt KV. A request this rank
        does not expect (released meanwhile) reads as FAILED."""
        return {rid: self.connector.poll(rid) for rid in request_ids}

    def release_kv(self, request_id: str) -> None:
        self.connector.release(request_id)

    def close(self) -> None:
        self.connector.close()

    # ---- leader: requests ---------------------------------------------------------------
    def start(self) -> None:
        self.peers_kv = tuple(self.leader.ranks.call_all(DecodeRole.kv_peer))

    def handle(self, request: LeaderRequest) -> object:
        match request:
            case Reserve(spec, prefill_tp, prefill_cp):
                return self.reserve(spec, prefill_tp, prefill_cp)
            case Admit(request_id, first_token_id):
                return self.admit(request_id, first_token_id)
            case Abort(request_id):
                return self.abort(request_id)
        raise not_taken(self, self.cfg.name, request)

    def reserve(self, spec: RequestSpec, prefill_tp: int = 1,
                prefill_cp: int = 1) -> Reservation | Rejection:
        """Take blocks for prompt + max_tokens and arm every rank's receiver for a prefill
        instance of ``prefill_cp`` x ``prefill_tp`` ranks (the transfer plan's sizes).

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        leader = self.leader
        leader.check_in_service()  # NOTE: before the lock, which a step may hold
        with leader.lock:
            leader.check_in_service()
            req = Request(spec)
            refused = self._refusal(spec, leader.scheduler.blocks_for(spec))
            if refused is None and leader.scheduler.allocate(req) is None:
                refused = self._full(spec, leader.scheduler.blocks_for(spec))
            if refused is not None:
                return refused
            blocks, held = req.blocks, req.num_cached_tokens
            self.reserved[spec.request_id] = ReservedRequest(
                req, DecodeRequestState.WAITING_FOR_FIRST_TOKEN,
                deadline=time.monotonic() + ORPHAN_FACTOR * self.cfg.transfer.completion_timeout_s)
        try:
            # NOTE: the prefix cache's tokens [0, held) are not shipped: cells pre-marked
            # NOTE: V4: staging rows, each layer its kind's own count (no padding rows)
            rows, per_layer = (spec.num_prompt_tokens, None) if self.staged_rows is None else \
                (self.staged_rows(spec.num_prompt_tokens),
                 self.runner.layer_rows(spec.num_prompt_tokens))
            leader.ranks.call_all(DecodeRole.expect_kv, spec.request_id, rows, prefill_tp,
                                  prefill_cp, held, per_layer)
        except RankFailure as exc:
            leader.mark_broken(str(exc))
            self._drop_reserved(spec.request_id)
            raise leader.out_of_service() from exc
        except Exception:
            self._drop_reserved(spec.request_id)
            raise
        return Reservation(spec.request_id, self.cfg.name, blocks.block_ids,
                           self.cfg.scheduler.block_size, self.peers_kv,
                           num_cached_tokens=held)

    def _refusal(self, spec: RequestSpec, need: int) -> Rejection | None:
        """Why ``spec`` (``need`` blocks) is refused whatever the free blocks (too big, aborted,
        id in use), or None; caller holds the lock (whether it fits now: ``_full``)."""
        leader, rid = self.leader, spec.request_id
        reason = leader.too_big(need) or leader.scheduler.refusal(spec)
        if reason is not None:
            return Rejection(rid, reason, retryable=False)
        if leader.has_tombstone(rid):
            return Rejection(rid, f"request {rid!r} was aborted before its reservation",
                             retryable=False)
        if rid in self.reserved or leader.scheduler.find(rid):
            return Rejection(rid, f"request id {rid!r} is already on {self.cfg.name}: use a "
                             "fresh id", retryable=False)
        return None

    def _full(self, spec: RequestSpec, need: int) -> Rejection:
        """The retryable refusal of a reservation that does not fit now."""
        pool, v4 = self.leader.pool, self.v4_shortage(spec)  # NOTE: "" unless V4's groups
        groups = self.leader.scheduler.admission_need(spec) or {}
        return Rejection(spec.request_id, f"{self.cfg.name} is full ({pool.num_free_blocks} of "
                         f"{pool.num_blocks} blocks free, {need} needed{v4})", retryable=True,
                         blocks_needed=need, group_blocks_needed=tuple(groups.items()))

    def admit(self, request_id: str, first_token_id: int) -> None:
        """Prefill's first token arrived; the request runs once its KV is complete, or fails
        ``completion_timeout_s`` from now. Returns at once: it never takes the lock a step in
        progress holds (the loop applies it before its next step, :meth:`_apply_first_tokens`).

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        self.leader.check_in_service()
        deadline = time.monotonic() + self.cfg.transfer.completion_timeout_s
        self.first_tokens.put((request_id, first_token_id, deadline))
        self.leader.wake.set()

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; blocks freed once receivers dropped it."""
        leader = self.leader
        with leader.lock:
            if request_id not in self.reserved and leader.scheduler.find(request_id) is None:
                leader.add_tombstone(request_id)  # a reserve still on its way is refused
                return False
        if self._drop_reserved(request_id) is not None:
            found = True
        else:
            with leader.lock:
                found = leader.scheduler.remove(request_id) is not None
        if found:
            leader.emit_end(request_id, "abort")
        return found

    # ---- leader: the loop ---------------------------------------------------------------
    def step(self) -> bool:
        leader = self.leader
        self._apply_first_tokens()
        settled = self._settle_reserved()
        if not leader.agree_to_step():
            return settled
        with leader.lock:
            result = leader.step()
            if result is not None:
                leader.finish_sampled(result.sampled, accepted=result.accepted)
                for rid, error in result.failed.items():
                    leader.fail_request(rid, error)
        return result is not None or settled

    def _apply_first_tokens(self) -> None:
        """Each admitted reservation now waits for its KV (one aborted meanwhile is gone: its
        first token is dropped)."""
        while True:
            try:
                request_id, token, deadline = self.first_tokens.get_nowait()
            except queue.Empty:
                return
            with self.leader.lock:
                entry = self.reserved.get(request_id)
                if entry is not None:
                    entry.request.output_token_ids = [token]
                    entry.state = DecodeRequestState.WAITING_FOR_KV
                    entry.deadline = deadline

    def _settle_reserved(self) -> bool:
        """Ask every rank about the KV of each request waiting for KV or past its deadline,
        and settle each; True when one joined the batch or failed."""
        now = time.monotonic()
        with self.leader.lock:
            rids = [rid for rid, entry in self.reserved.items()
                    if entry.state is DecodeRequestState.WAITING_FOR_KV or now > entry.deadline]
        if not rids:
            return False
        statuses = self.leader.ranks.call_all(DecodeRole.kv_status, rids)
        settled = [self._settle(rid, [s[rid] for s in statuses], now) for rid in rids]
        return any(settled)

    def _settle(self, request_id: str, per_rank: list[KVStatus], now: float) -> bool:
        """Move one reserved request into the batch (KV complete on every rank, first token
        admitted), or fail it (a rank failed, or past its deadline); True unless it waits on."""
        with self.leader.lock:
            entry = self.reserved.get(request_id)
        if entry is None:  # aborted meanwhile (and freed there)
            return True
        errors = [s.error for s in per_rank if s.state is KVPoll.FAILED]
        complete = all(s.state is KVPoll.SUCCESS for s in per_rank)
        if complete and entry.state is DecodeRequestState.WAITING_FOR_KV:
            tails = [s.tail_s for s in per_rank if s.tail_s is not None]
            if len(tails) == len(per_rank):
                self.kv_tail = self.kv_tail.add(max(tails))
            hidden = next((s.draft_hidden for s in per_rank if s.draft_hidden), b"")
            self._join_batch(request_id, hidden)
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

    def _join_batch(self, request_id: str, draft_hidden: bytes = b"") -> None:
        """Hand a request whose KV is complete to the scheduler (its KV counts as computed).

        With MTP, ``draft_hidden`` (the done records' fp32 hidden state at the last prompt
        position P - 1) becomes the request's :class:`DraftInput`: its first step runs the
        MTP module at P - 1 (writing that row of the MTP cache, as every decode step does
        for the rows it drafts from) and verifies the drafts with the first token. Without
        it (a prefill that sent none) the last prompt token counts as not computed: the first
        step computes it again with the first token (same KV) and drafting starts a step
        later. DeepSeek-V4: every rank rebuilds the request's cache from its staging rows
        first; a rebuild that raises fails the request (blocks freed once); once rebuilt, its
        staging blocks but the first go back."""
        self.leader.ranks.call_all(DecodeRole.release_kv, request_id)
        if self.staged_rows is not None and not self._admit_staged(request_id):
            return
        with self.leader.lock:
            entry = self.reserved.pop(request_id, None)
            if entry is not None:  # else aborted meanwhile (and freed there)
                req = entry.request
                self._drop_staging_blocks(req)
                req.num_computed_tokens = req.num_prompt_tokens
                if self.leader.scheduler.num_speculative_tokens:
                    req.draft = self._first_draft(req, draft_hidden)
                    if req.draft is None:  # NOTE: recomputed with the first token
                        req.num_computed_tokens -= 1
                self.leader.scheduler.add(req)
        if entry is None and self.staged_rows is not None:
            # NOTE: aborted while its V4 cache was rebuilt: the abort's free may have come
            # before the cache had an owner, so it is dropped here (idempotent)
            self.leader.ranks.call_all(DecodeRole.discard_staged, request_id)

    def _first_draft(self, req: Request, draft_hidden: bytes) -> DraftInput | None:
        """The first step's :class:`DraftInput` from prefill's hidden state (None: none came,
        or not one hidden state's worth of bytes)."""
        if len(draft_hidden) != 4 * self.hidden_size:
            if draft_hidden:
                log.warning("%s: %s: draft hidden state of %d bytes, expected %d: ignored",
                            self.cfg.name, req.request_id, len(draft_hidden),
                            4 * self.hidden_size)
            return None
        hidden = torch.frombuffer(bytearray(draft_hidden), dtype=torch.float32)  # [hidden]
        return DraftInput(hidden.view(1, -1).to(self.device), req.num_prompt_tokens - 1,
                          (req.output_token_ids[-1],))

    # ---- leader: failures ---------------------------------------------------------------
    def _drop_reserved(self, request_id: str) -> Request | None:
        """Forget a reserved request on every rank, then free its blocks (in that order);
        never raises."""
        with self.leader.lock:
            entry = self.reserved.pop(request_id, None)
        if entry is None:
            return None
        try:
            self._release_everywhere(request_id)
        finally:
            with self.leader.lock:
                self.leader.pool.free(entry.request.blocks)
        return entry.request

    def _release_everywhere(self, request_id: str) -> None:
        """Every rank's receiver forgets the request (only this rank's once out of service:
        nothing reuses the blocks); never raises."""
        try:
            if self.leader.broken is None:
                self.leader.ranks.call_all(DecodeRole.release_kv, request_id)
                return
        except RankFailure as exc:
            self.leader.mark_broken(str(exc))
        except Exception:  # noqa: BLE001 - a live rank that raised: logged, blocks freed
            log.exception("%s: releasing the KV of %s failed", self.cfg.name, request_id)
            return
        try:
            self.release_kv(request_id)
        except Exception:  # noqa: BLE001
            log.exception("%s: releasing the KV of %s failed", self.cfg.name, request_id)

    def _fail_reserved(self, request_id: str, error: str, kv_failed: bool) -> None:
        """End a reserved request with ``error`` and free its blocks; ``kv_failed``: its KV
        broke or was missing (counted in ``kv_failures``). Never the request's own fault, so
        the event is retryable (the router places it again while no token was streamed)."""
        if self._drop_reserved(request_id) is not None:
            if kv_failed:
                self.kv_failures += 1
            self.leader.emit_end(request_id, "error", error, retryable=True)

    def fail_all(self, error: str) -> None:
        """End every request, reserved ones included, with ``error``; never raises."""
        self.leader.fail_scheduled(error, self.leader.fail_request)
        with self.leader.lock:
            rids = list(self.reserved)
        for rid in rids:
            try:
                self._fail_reserved(rid, error, kv_failed=False)
            except Exception:  # noqa: BLE001 - the others still get their event
                log.exception("%s: failing %s failed", self.cfg.name, rid)

    # ---- leader: status -----------------------------------------------------------------
    def num_active(self) -> int:
        return self.leader.num_scheduled() + len(self.reserved)

    def status_fields(self, timeout_s: float | None) -> dict:
        return {"kv_failures": self.kv_failures, "kv_tail": self.kv_tail}

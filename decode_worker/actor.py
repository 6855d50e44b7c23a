"""Decode rank actor: reservations, KV receive, continuous-batching decode.

Protocol (DESIGN.md "One request"), decode side:

1. ``reserve(spec, prefill_tp)``: take blocks for prompt + max_tokens BEFORE prefill computes
   and tell every rank's KV receiver to expect the prompt's KV; or a :class:`Rejection`.
2. KV arrives on the receiver threads of every rank, straight into the reserved slots.
3. ``admit(request_id, first_token_id)``: prefill's first token; once every rank has every
   layer, the request joins the running batch with ``num_computed_tokens = prompt``.
4. Tokens stream out through ``poll``; at the end the blocks are freed exactly once.

Abort/failure: the receivers forget the request first (payloads for unknown requests are
dropped, never written), then the blocks are freed.
"""

from __future__ import annotations

import time

from engine.scheduler import DECODE, Request
from prefill_worker.messages import KVPeer, Rejection, Reservation, RequestSpec, TokenEvent
from prefill_worker.kv_setup import make_layout, make_transfer_config
from prefill_worker.leader import LeaderRank

# NOTE: a reservation never admitted (router gone) is freed after this many completion timeouts.
ORPHAN_FACTOR = 4


class DecodeRank(LeaderRank):
    """Rank actor of a decode instance. Leader methods: ``reserve``, ``admit``, ``abort``,
    ``poll``, ``status``, ``drain``, ``shutdown``; every rank: ``kv_peer``, ``expect_kv``,
    ``kv_state``, ``release_kv``."""

    policy = DECODE
    source = "decode"

    def setup_role(self) -> None:
        from kv_transfer import DecodeKVConnector

        self.connector = DecodeKVConnector(
            self.runner.kv_cache, make_layout(self.runner, self.cfg), self.cfg.name, self.rank,
            make_transfer_config(self.cfg, completion_factor=ORPHAN_FACTOR),
            host=self.cfg.bind_host)
        if self.rank == 0:
            self.setup_leader()
            self.pending: dict[str, tuple[Request, float]] = {}  # reserved, KV not yet complete
            self.admitted: dict[str, float] = {}  # request id -> monotonic admit time
            self.peers_kv: tuple[KVPeer, ...] = ()
            self.kv_failures = 0  # requests failed for missing or broken KV

    # ---- every rank ---------------------------------------------------------------------
    def kv_peer(self) -> KVPeer:
        host, port = self.connector.address
        return KVPeer(self.cfg.name, self.rank, host, port)

    def expect_kv(self, request_id: str, num_tokens: int, prefill_tp: int) -> None:
        self.connector.expect(request_id, num_tokens, prefill_tp)

    def kv_state(self, request_ids: list[str]) -> dict[str, str | None]:
        """request id -> "complete", an error text, or None (still arriving)."""
        out: dict[str, str | None] = {}
        for rid in request_ids:
            failure = self.connector.failure(rid)
            out[rid] = failure or ("complete" if self.connector.is_complete(rid) else None)
        return out

    def release_kv(self, request_id: str) -> None:
        self.connector.release(request_id)

    def close_role(self) -> None:
        self.connector.close()

    # ---- leader -------------------------------------------------------------------------
    def start(self) -> None:
        self.peers_kv = tuple(self.call_all("kv_peer"))
        super().start()

    def reserve(self, spec: RequestSpec, prefill_tp: int = 1) -> Reservation | Rejection:
        """Take blocks for prompt + max_tokens and arm every rank's receiver."""
        with self._lock:
            need = self.scheduler.blocks_for(spec)
            reason = self.too_big(need)
            if reason is not None:
                return Rejection(spec.request_id, reason, retryable=False)
            if self.has_tombstone(spec.request_id):
                return Rejection(spec.request_id, f"request {spec.request_id!r} was aborted "
                                 "before its reservation", retryable=False)
            if spec.request_id in self.pending or self.scheduler.find(spec.request_id):
                return Rejection(spec.request_id, f"request id {spec.request_id!r} is already "
                                 f"on {self.cfg.name}: use a fresh id", retryable=False)
            if not self.pool.can_allocate(need):
                return Rejection(spec.request_id, f"{self.cfg.name} is full "
                                 f"({self.pool.num_free_blocks} of {self.pool.num_blocks} "
                                 f"blocks free, {need} needed)", retryable=True)
            blocks = self.pool.allocate(need)
            self.pending[spec.request_id] = (Request(spec, blocks=blocks), time.monotonic())
        try:
            self.call_all("expect_kv", spec.request_id, spec.num_prompt_tokens, prefill_tp)
        except Exception:
            self._drop_pending(spec.request_id)
            raise
        return Reservation(spec.request_id, self.cfg.name, blocks.block_ids,
                           self.cfg.block_size, self.peers_kv)

    def admit(self, request_id: str, first_token_id: int) -> None:
        """Prefill's first token arrived; the request runs once its KV is complete."""
        with self._lock:
            entry = self.pending.get(request_id)
            if entry is None:
                return
            entry[0].output_token_ids = [first_token_id]
            self.admitted[request_id] = time.monotonic()
        self._wake.set()

    def _drop_pending(self, request_id: str) -> Request | None:
        """Forget a reserved request on every rank, then free its blocks (in that order)."""
        with self._lock:
            entry = self.pending.pop(request_id, None)
            self.admitted.pop(request_id, None)
        if entry is None:
            return None
        try:
            self.call_all("release_kv", request_id)
        finally:
            self.pool.free(entry[0].blocks)
        return entry[0]

    def abort(self, request_id: str) -> bool:
        """End a request wherever it is; blocks freed once receivers dropped it."""
        with self._lock:
            if request_id not in self.pending and self.scheduler.find(request_id) is None:
                self.add_tombstone(request_id)  # a reserve still on its way is refused
                return False
        if self._drop_pending(request_id) is not None:
            found = True
        else:
            with self._lock:
                found = self.scheduler.remove(request_id) is not None
        if found:
            self.emit(TokenEvent(request_id, (), "abort", source=self.source,
                                 instance=self.cfg.name))
        return found

    def _overdue(self, request_id: str, now: float) -> bool:
        """Admitted and KV still missing after ``completion_timeout_s``, or never admitted
        within ``ORPHAN_FACTOR`` times that (the router went away)."""
        _, since = self.pending[request_id]
        admitted_at = self.admitted.get(request_id)
        if admitted_at is not None:
            return now - admitted_at > self.cfg.completion_timeout_s
        return now - since > ORPHAN_FACTOR * self.cfg.completion_timeout_s

    def _admit_complete(self) -> bool:
        """Move admitted requests whose KV is complete on every rank into the batch; fail
        overdue ones. True when a request moved or failed."""
        now = time.monotonic()
        with self._lock:
            rids = [r for r in self.pending if r in self.admitted or self._overdue(r, now)]
        if not rids:
            return False
        states = self.call_all("kv_state", rids)
        changed = False
        for rid in rids:
            per_rank = [s[rid] for s in states]
            errors = [s for s in per_rank if s not in (None, "complete")]
            if errors or (None in per_rank and self._overdue(rid, now)):
                why = errors[0] if errors else (
                    f"KV for the prompt did not reach every rank of {self.cfg.name} within "
                    f"{self.cfg.completion_timeout_s} s of the first token")
                if self._drop_pending(rid) is not None:
                    self.kv_failures += 1
                    self.emit(TokenEvent(rid, (), "error", why, self.source, self.cfg.name))
                changed = True
            elif None not in per_rank and rid in self.admitted:
                self.call_all("release_kv", rid)
                with self._lock:
                    entry = self.pending.pop(rid, None)
                    self.admitted.pop(rid, None)
                    if entry is not None:  # else aborted meanwhile (and freed there)
                        entry[0].num_computed_tokens = entry[0].num_prompt_tokens
                        self.scheduler.add(entry[0])
                changed = True
        return changed

    def step(self) -> bool:
        moved = self._admit_complete()
        with self._lock:
            result = self.leader_step()
            if result is not None:
                self.finish_sampled(result.sampled)
        return result is not None or moved

    def num_active(self) -> int:
        return super().num_active() + len(self.pending)

    def transfer_stats(self) -> dict:
        return {"kv_failures": self.kv_failures}

    def fail_all(self, error: str) -> None:
        super().fail_all(error)
        for rid in list(self.pending):
            if self._drop_pending(rid) is not None:
                self.emit(TokenEvent(rid, (), "error", error, self.source, self.cfg.name))

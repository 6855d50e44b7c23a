"""The decode role's DeepSeek-V4 parts (:class:`V4Staged`, a base of
:class:`decode_worker.role.DecodeRole`): rebuilding a request's V4 cache from the staging rows
the transfer wrote into its first slots, and what a refusal says about V4's per-group blocks
(docs/kv_transfer.md "DeepSeek-V4: staged per-layer state")."""

from __future__ import annotations

import logging

from engine.block_pool import slot_mapping
from engine.request import RequestSpec
from rank.failures import RankFailure

log = logging.getLogger(__name__)


class V4Staged:
    """DeepSeek-V4 methods of the decode role (the role's ``runner``, ``cfg``, ``leader``,
    ``reserved``, ``staged_rows`` and ``_fail_reserved``). Rank-to-rank calls (every rank):
    :meth:`admit_staged`, :meth:`discard_staged`."""

    # ---- every rank ---------------------------------------------------------------------
    def discard_staged(self, request_id: str) -> None:
        """DeepSeek-V4: free the request's rebuilt cache if it still has one (an abort that
        raced the rebuild); no-op otherwise."""
        self.runner.discard(request_id)

    def admit_staged(self, request_id: str, block_ids: tuple[int, ...],
                     num_tokens: int, released: tuple[str, ...] = ()) -> None:
        """DeepSeek-V4: free the caches of the leader's ``released`` requests (under TP, what
        its pool released since the last step: every rank's pools then hold the same), then
        rebuild the request's cache from the staging rows the transfer wrote into its first
        slots, each layer its own rows (:meth:`engine.v4.runner.V4Runner.admit_staged`).

        Raises:
            ValueError / NoFreeBlocksError: from the runner (the rows are not the specs'; a
                group's pool short, which admission by :mod:`engine.v4.admission` rules out).
        """
        if released:
            self.runner.free_requests(released)
        slots = slot_mapping(block_ids, 0, self.staged_rows(num_tokens),
                             self.cfg.scheduler.block_size)
        self.runner.admit_staged(request_id, block_ids, slots, num_tokens)

    # ---- leader -------------------------------------------------------------------------
    def _admit_staged(self, request_id: str) -> bool:
        """V4: :meth:`admit_staged` on every rank; False (request failed) when one raised."""
        with self.leader.lock:
            entry = self.reserved.get(request_id)
        if entry is None:  # aborted meanwhile (and freed there)
            return False
        req = entry.request
        try:
            self.leader.ranks.call_all(V4Staged.admit_staged, request_id,
                                       req.blocks.block_ids, req.num_prompt_tokens,
                                       self.leader.ranks.take_releases())
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - that request fails, the loop goes on
            log.exception("%s: rebuilding the V4 cache of %s failed", self.cfg.name, request_id)
            self._fail_reserved(request_id, f"{self.cfg.name}: the DeepSeek-V4 state shipped "
                                f"for {request_id} could not be rebuilt: {exc}", kv_failed=True)
            return False
        return True

    def _drop_staging_blocks(self, req) -> None:
        """V4, once every rank rebuilt ``req``'s cache (the staging rows are read): all its
        scheduler blocks but the first (which names its V4 cache until it ends) go back to
        the staging pool (:meth:`engine.block_pool.BlockPool.truncate`); no-op otherwise.
        Caller holds the leader's lock and owns ``req`` (out of ``reserved``)."""
        if self.staged_rows is not None and len(req.blocks) > 1:
            req.blocks = self.leader.pool.truncate(req.blocks, 1)

    def v4_shortage(self, spec: RequestSpec) -> str:
        """``"; "`` + the V4 groups ``spec`` does not fit now (a full reservation's message;
        caller holds the leader's lock), or "" (not V4, or they fit)."""
        scheduler = self.leader.scheduler
        need = scheduler.admission_need(spec)
        short = "" if need is None else scheduler.admission.describe(need)
        return f"; {short}" if short else ""

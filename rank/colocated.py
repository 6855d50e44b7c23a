"""Colocated rank: one instance runs both phases (chunked prefill and decode), no transfer.

It is the baseline disaggregated output is compared against, token for token.
"""

from __future__ import annotations

from engine.scheduler import COLOCATED
from rank.messages import TokenEvent
from engine.request import RequestSpec
from rank.leader import LeaderRank


class ColocatedRank(LeaderRank):
    """Rank actor of a colocated instance. Leader methods: ``generate``, ``abort``, ``poll``,
    ``status``, ``drain``, ``shutdown``."""

    policy = COLOCATED
    source = "colocated"

    def setup_role(self) -> None:
        if self.rank == 0:
            self.setup_leader()

    def generate(self, spec: RequestSpec) -> None:
        """Queue a request; its tokens arrive through ``poll``. Too big -> an error event.

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        self.check_in_service()  # NOTE: before the lock, which a step may hold
        with self._lock:
            self.enqueue(spec)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; True when it was here."""
        with self._lock:
            req = self.scheduler.remove(request_id)
            if req is None:
                self.add_tombstone(request_id)
        if req is not None:
            self.emit(TokenEvent(request_id, (), "abort", source=self.source,
                                 instance=self.cfg.name))
        return req is not None

    def step(self) -> bool:
        if not self.agree_to_step():
            return False
        with self._lock:
            result = self.leader_step()
            if result is None:
                return False
            self.finish_sampled(result.sampled)
            self.fail_requests(result.failed)
            return True

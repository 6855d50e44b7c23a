"""Colocated role: one instance runs both phases (chunked prefill and decode), no transfer.

It is the baseline disaggregated output is compared against, token for token. Requests:
:class:`~rank.messages.Generate` and :class:`~rank.messages.Abort`.
"""

from __future__ import annotations

from engine.request import RequestSpec
from engine.scheduler import COLOCATED
from rank.messages import Abort, Generate, LeaderRequest
from rank.role import RankParts, Role, not_taken


class ColocatedRole(Role):
    """Role of a colocated instance (nothing to do on a follower but step)."""

    policy = COLOCATED
    source = "colocated"

    def __init__(self, parts: RankParts) -> None:
        self.name = parts.cfg.name
        self.leader = parts.leader

    def handle(self, request: LeaderRequest) -> object:
        match request:
            case Generate(spec):
                return self.generate(spec)
            case Abort(request_id):
                return self.abort(request_id)
        raise not_taken(self, self.name, request)

    def generate(self, spec: RequestSpec) -> None:
        """Queue a request; its tokens arrive through ``poll``. Too big -> an error event.

        Raises:
            InstanceOutOfService: a rank of this instance is dead or hung.
        """
        self.leader.check_in_service()  # NOTE: before the lock, which a step may hold
        with self.leader.lock:
            self.leader.enqueue(spec)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; True when it was here."""
        with self.leader.lock:
            req = self.leader.scheduler.remove(request_id)
            if req is None:
                self.leader.add_tombstone(request_id)
        if req is not None:
            self.leader.emit_end(request_id, "abort")
        return req is not None

    def step(self) -> bool:
        leader = self.leader
        if not leader.agree_to_step():
            return False
        with leader.lock:
            result = leader.step()
            if result is None:
                return False
            leader.finish_sampled(result.sampled, accepted=result.accepted)
            for rid, error in result.failed.items():
                leader.fail_request(rid, error)
            return True

    def fail_all(self, error: str) -> None:
        self.leader.fail_scheduled(error, self.leader.fail_request)

    def num_active(self) -> int:
        return self.leader.num_scheduled()

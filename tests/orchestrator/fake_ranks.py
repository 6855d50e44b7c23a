"""A fake rank actor class and fake roles with the real contract (orchestrator/deploy/cluster.py:
``bring_up(cfg, roles=ROLES, rank_class=FakeRank)``), for Ray tests.

They compute nothing: the leader scripts tokens like tests/orchestrator/fakes.py and records
every bring-up call so tests can check the sequence.
"""

from __future__ import annotations

import os
import threading

from kv_transfer import KVPeer
from rank.event_stream import EventStream
from rank.messages import (Abort, Admit, Generate, InstanceStatusInfo, Prefill, Reservation,
                           Reserve, TokenEvent)
from tests.orchestrator.fakes import expected_tokens


class FakeRank:
    """``rank.rank.Rank``'s contract; ``role`` is a fake role class of this module."""

    def __init__(self, cfg, rank: int, role: type) -> None:
        self.cfg, self.rank, self.role = cfg, rank, role(self)
        self.log: list[tuple] = [("init", cfg.name, rank)]
        self._events: list[TokenEvent] = []
        self._cond = threading.Condition()
        self._specs = {}
        self.stream = EventStream(cfg.name, "127.0.0.1")  # the real leader end

    def node_info(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), self.cfg.parallel.device

    def open_tp_store(self) -> tuple[str, int]:
        assert self.rank == 0, "only the leader opens the TP store"
        self.log.append(("open_tp_store",))
        return "127.0.0.1", 29500 + len(self.cfg.name)

    def open_ep_store(self) -> tuple[str, int]:
        assert self.rank == 0 and self.cfg.parallel.dp_rank == 0, "EP rank 0 opens it"
        self.log.append(("open_ep_store",))
        return "127.0.0.1", 29600

    def init_rank(self, host: str, port: int, peers: list,
                  ep_store: tuple[str, int] | None = None) -> None:
        if self.cfg.name == "decode-0" and self.rank == 1 and self.cfg.scheduler.max_num_seqs == 13:
            raise RuntimeError("simulated device init failure")
        self.log.append(("init_rank", host, port, len(peers), *(ep_store or ())))

    def start(self) -> None:
        self.log.append(("start",))

    def get_log(self) -> list[tuple]:
        return self.log

    def _emit(self, event: TokenEvent) -> None:
        if self.stream.subscribed:
            self.stream.add(event)
            self.stream.flush(self.cfg.scheduler.num_kv_blocks - len(self._specs))
            return
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def open_events(self, subscriber: str, beat_s=None, status_s=None):
        address = self.stream.open(subscriber, beat_s)  # NOTE: no loop here: beats on emits only
        self.stream.flush(self.cfg.scheduler.num_kv_blocks - len(self._specs))
        return address

    def poll(self, timeout_s: float, kv_events: bool = False) -> list[TokenEvent]:
        with self._cond:
            self._cond.wait_for(lambda: self._events, timeout=timeout_s)
            out, self._events = self._events, []
        return out

    def request(self, request):
        if isinstance(request, Abort):
            return self.abort(request.request_id)
        return self.role.handle(request)

    def abort(self, request_id: str) -> bool:
        self.log.append(("abort", request_id))
        return self._specs.pop(request_id, None) is not None

    def status(self) -> InstanceStatusInfo:
        blocks = self.cfg.scheduler.num_kv_blocks
        return InstanceStatusInfo(name=self.cfg.name, role=self.cfg.role,
                                  tp=self.cfg.parallel.tp,
                                  ranks=((0, "n", self.cfg.parallel.device, os.getpid()),),
                                  total_blocks=blocks, free_blocks=blocks - len(self._specs))

    def drain(self, timeout_s: float) -> None:
        pass

    def shutdown(self) -> None:
        self.log.append(("shutdown",))
        self.stream.close()


class FakePrefill:
    def __init__(self, rank: FakeRank) -> None:
        self.rank = rank

    def handle(self, request: Prefill) -> None:
        spec, name = request.spec, self.rank.cfg.name
        first = expected_tokens(spec.prompt_token_ids, 1)[0]
        self.rank._emit(TokenEvent(spec.request_id, (first,), None, None, "prefill", name))


class FakeDecode:
    def __init__(self, rank: FakeRank) -> None:
        self.rank = rank

    def handle(self, request: Reserve | Admit):
        cfg, specs = self.rank.cfg, self.rank._specs
        match request:
            case Reserve(spec):
                specs[spec.request_id] = spec
                return Reservation(spec.request_id, cfg.name, (0,), cfg.scheduler.block_size,
                                   tuple(KVPeer(cfg.name, r, "127.0.0.1", 1)
                                         for r in range(cfg.parallel.tp)))
            case Admit(request_id):
                spec = specs.pop(request_id)
                rest = expected_tokens(spec.prompt_token_ids, spec.sampling.max_tokens)[1:]
                self.rank._emit(TokenEvent(request_id, tuple(rest), "length", None, "decode",
                                           cfg.name))


class FakeColocated:
    def __init__(self, rank: FakeRank) -> None:
        self.rank = rank

    def handle(self, request: Generate) -> None:
        spec = request.spec
        toks = expected_tokens(spec.prompt_token_ids, spec.sampling.max_tokens)
        self.rank._emit(TokenEvent(spec.request_id, tuple(toks), "length", None, "colocated",
                                   self.rank.cfg.name))


ROLES = {"prefill": FakePrefill, "decode": FakeDecode, "colocated": FakeColocated}

"""What every rank actor has in common: its TP group (a prefill instance with ``cp > 1``: its
CP group, tp 1), its model shard, the SPMD step, and
(on the leader) the step loop thread and the event queue the router long-polls.

Lifecycle (driven by the orchestrator, see orchestrator/deploy/cluster.py):
``__init__(cfg, rank)`` -> leader ``open_tp_store()`` (and, with ``ep``, the role's first
leader ``open_ep_store()``) -> every rank ``init_rank(host, port, peers, ep_store)``
(collective: TP rendezvous, EP rendezvous over every rank of the role, model load) -> leader
``start()`` -> ... -> ``drain(timeout_s)`` -> ``shutdown()``.

Expert parallelism (``cfg.parallel.ep``): every forward is collective over all ranks of the
role, so with several DP ranks the leaders agree on each forward first (``dp_sync``, see
rank/dp_sync.py) and a rank with nothing to run runs an empty forward
(:meth:`RankBase.forward`).

SPMD: only the leader schedules. Each step it sends the step to every other rank over the
step channel (rank/step_channel.py: one TCP connection per follower, opened at
bring-up; no Ray call per step), runs the same step itself, then reads the followers' acks;
the TP all-reduces inside the model keep the ranks in lock step. A rank that does not ack
within ``step_timeout_s`` fails the step. The leader records where each step's time goes
(rank/step_timing.py; ``status().step_timings``).

Role hooks (only the role classes PrefillRank, DecodeRank and ColocatedRank override them):

- ``setup_role()``: every rank, at the end of ``init_rank`` once the model runner exists;
  builds the role's state (KV connector; on the leader the scheduler, via
  ``LeaderRank.setup_leader``).
- ``after_step(step_inputs)``: every rank, right after its model step (prefill queues
  KV sends here).
- ``close_role()``: every rank, at the end of ``shutdown`` after the loop thread stopped;
  releases what ``setup_role`` opened (not called when ``setup_role`` never returned: an
  interrupted start-up).
- leader only: ``step()`` (the loop's iteration), ``fail_all(error)``, ``num_active()``,
  ``status()``; ``LeaderRank`` implements the last three, ``transfer_stats()`` adds the role's
  fields to ``status()``.

Failures: the loop thread never ends on an error. A follower that is dead (its actor died) or
hung (no answer within ``step_timeout_s``) is a :class:`RankFailure`: the instance goes out of
service at once (``broken`` holds why), the loop ends every request with an error event, and
the leader refuses new work with ``InstanceOutOfService`` until orch replaces the instance.
Any other error of a step fails only the requests it concerns (see ``LeaderRank.leader_step``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch

from engine import envs
from rank.config import InstanceConfig
from rank.dp_sync import DPSync
from rank.ep_setup import join_dp_sync, join_ep_group
from rank.messages import InstanceOutOfService, InstanceStatusInfo, TokenEvent
from rank.failures import RankFailure, await_followers
from rank.step_channel import (StepChannelFollower, StepChannelLeader,
                                         connect_follower, open_leader)
from rank.step_timing import StepTimer

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RankBase(ABC):
    """Base of PrefillRank, DecodeRank and ColocatedRank (plain classes; Ray wraps them).

    Args:
        cfg: the instance's config.
        rank: this actor's TP rank (0 = leader).
    """

    def __init__(self, cfg: InstanceConfig, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self.runner = None
        self.peers: list = []
        self._store = None
        self._ep_store = None  # the role's EP store, on the leader that opened it
        self.dp_sync: DPSync | None = None  # leader of an EP role with dp > 1
        self._events: queue.Queue[TokenEvent] = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._loop_thread: threading.Thread | None = None
        self._role_ready = False  # setup_role returned: close_role has something to close
        self._step_leader: StepChannelLeader | None = None  # leader with followers
        self._step_follower: StepChannelFollower | None = None  # a follower
        self.step_timer = StepTimer()  # leader: where step time goes
        self._lock = threading.RLock()  # guards the scheduler between RPCs and the loop
        # NOTE: why the instance is out of service (a rank is dead or hung), set once; read
        # without the lock (the loop ends whatever a racing RPC still queued).
        self.broken: str | None = None
        if not cfg.parallel.bind_host:  # multi-node: listen on this node's address
            import ray

            self.cfg = cfg = replace(cfg, parallel=replace(
                cfg.parallel, bind_host=ray.util.get_node_ip_address()))
        if cfg.parallel.bind_host == "127.0.0.1":
            # NOTE: keep Gloo's sockets on loopback too (it otherwise resolves the hostname).
            envs.GLOO_SOCKET_IFNAME.set_default("lo")
        torch.set_num_threads(envs.ORCH_TORCH_THREADS.get())

    def __repr__(self) -> str:
        # NOTE: Ray shows this as the actor's name (log prefixes, `ray list actors`,
        # ray.util.state's repr_name), so a rank is found as "decode-0:1".
        return f"{self.cfg.name}:{self.rank}"

    # ---- bring-up -----------------------------------------------------------------------
    def node_info(self) -> tuple[str, str]:
        """(Ray node id, device) of this rank."""
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return node, self.cfg.parallel.device

    def open_tp_store(self) -> tuple[str, int]:
        """Leader only: open the TCPStore the instance's ranks rendezvous on, and (with
        followers) the step channel's listening socket, whose address the store carries;
        (host, port) of the store."""
        from torch.distributed import TCPStore

        par = self.cfg.parallel
        self._store = TCPStore(par.bind_host, 0, par.ranks, is_master=True,
                               timeout=timedelta(seconds=self.cfg.transfer.connect_timeout_s),
                               wait_for_workers=False)
        if par.ranks > 1:
            self._step_leader = open_leader(self._store, par.bind_host, par.ranks - 1)
        return par.bind_host, self._store.port

    def open_ep_store(self) -> tuple[str, int]:
        """The role's first leader (EP rank 0), with ``ep`` only: open the TCPStore every rank
        of the role rendezvous on for the EP group (and the leaders for the DP sync);
        (host, port)."""
        from torch.distributed import TCPStore

        self._ep_store = TCPStore(self.cfg.parallel.bind_host, 0, self.cfg.parallel.ep_size,
                                  is_master=True,
                                  timeout=timedelta(seconds=self.cfg.transfer.connect_timeout_s),
                                  wait_for_workers=False)
        return self.cfg.parallel.bind_host, self._ep_store.port

    def init_rank(self, host: str, port: int, peers: list,
                  ep_store: tuple[str, int] | None = None) -> None:
        """Join the TP group (and, with ``ep``, the role's EP group at ``ep_store`` and on the
        leader the DP sync), load the model shard, build role state. Collective.

        Raises:
            RuntimeError: rendezvous or model load failed (message names instance and rank).
        """
        from engine.parallel import init_cp_group, init_tp_group
        from engine.runner import ModelRunner

        self.peers = list(peers)
        par = self.cfg.parallel
        try:
            # NOTE: the instance's ranks are one TP group, or (cp > 1, tp 1) one CP group.
            init_group = init_cp_group if par.cp > 1 else init_tp_group
            group = init_group(self.rank, par.ranks, host, port, par.dist_backend,
                               self.cfg.transfer.connect_timeout_s, store=self._store)
            tp, cp = (None, group) if par.cp > 1 else (group, None)
            ep = join_ep_group(par, self.rank, ep_store, store=self._ep_store)
            # NOTE: Ray gives each rank actor one accelerator and hides the others
            # (CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES), so it is always index 0.
            device = "cpu" if par.device == "cpu" else f"{par.device}:0"
            self.runner = ModelRunner(self.cfg.checkpoint_dir,
                                      num_kv_blocks=self.cfg.scheduler.num_kv_blocks,
                                      block_size=self.cfg.scheduler.block_size,
                                      dtype=_DTYPES[self.cfg.dtype], tp=tp, device=device,
                                      ep=ep, fp8_storage=self.cfg.fp8_storage, cp=cp,
                                      layer_sharding=par.layer_sharding, graph=self.cfg.graph)
            if ep is not None and self.rank == 0:
                self.dp_sync = join_dp_sync(par, ep_store, self.cfg.transfer.connect_timeout_s,
                                            store=self._ep_store)
        except Exception as exc:
            raise RuntimeError(f"{self.cfg.name} rank {self.rank}: init failed: {exc}") from exc
        self.setup_role()
        self._role_ready = True
        if par.ranks > 1:
            self._join_step_channel(host, port)

    def _join_step_channel(self, host: str, port: int) -> None:
        """End of :meth:`init_rank` (role state exists): a follower connects to the leader's
        step channel (address from the TP store at ``host:port``) and starts serving steps;
        the leader waits until every follower did. Bounded by ``connect_timeout_s``.

        Raises:
            RuntimeError: the channel could not be set up (names instance and rank).
        """
        timeout_s = self.cfg.transfer.connect_timeout_s
        try:
            if self.rank == 0:
                self._step_leader.accept(timeout_s)
            else:
                self._step_follower = connect_follower((host, port), self.rank,
                                                       self.execute_step, f"{self}-steps",
                                                       timeout_s)
        except Exception as exc:
            raise RuntimeError(f"{self.cfg.name} rank {self.rank}: joining the step channel "
                               f"failed: {exc}") from exc

    def setup_role(self) -> None:
        """Role hook, every rank, end of :meth:`init_rank` (``self.runner`` exists, the loop
        is not started): build the role's state (KV connector; scheduler on the leader)."""

    # ---- SPMD ---------------------------------------------------------------------------
    def execute_step(self, steps: list, step_inputs: Any = None) -> None:
        """Follower side of one step (on the step channel's thread, from the leader's
        :meth:`run_step`): run the model on ``steps`` (:meth:`forward`), then
        :meth:`after_step` with the role's ``step_inputs``."""
        self.forward(steps)
        self.after_step(step_inputs)

    def forward(self, steps: list) -> torch.Tensor | None:
        """This rank's model forward of one step: ``[B, V]`` logits, None for no steps.

        With ``ep`` an empty step is an empty forward (``execute_empty``), so this rank meets
        the all-to-alls of the role's other DP ranks; and a step the runner refuses
        (``ValueError``, raised before the model runs) is followed by an empty forward for
        the same reason before the error goes on.

        Raises:
            ValueError: the runner refused the steps. Exception: what the forward raised.
        """
        ep = self.cfg.parallel.ep
        if not steps:
            if ep:
                self.runner.execute_empty()
            return None
        try:
            return self.runner.execute(steps)
        except ValueError:
            if ep:
                self.runner.execute_empty()
            raise

    def after_step(self, step_inputs: Any) -> None:
        """Role hook, every rank, right after this rank's model step (on the leader under its
        lock, on a follower on the step channel's thread); ``step_inputs`` is what the leader's
        ``step_inputs_for`` made for this step (None when it made nothing). It may queue work
        on this rank's own role state (KV sends), never touch the scheduler."""

    def run_step(self, steps: list, step_inputs: Any = None) -> torch.Tensor | None:
        """Leader: run one step on all ranks; the leader's logits ``[B, V]`` (None when
        ``steps`` is empty: with ``ep`` an empty forward on every rank, else nothing).

        Phases recorded in ``step_timer``: fanout, forward, after_step, follower_wait.
        NOTE: the loop thread only (one step at a time on the step channel).

        Raises:
            RankFailure: a follower died or did not finish within ``step_timeout_s``.
            Exception: what the leader's step or a follower's raised (a follower's carries a
                note naming its rank).
        """
        timeout_s = self.cfg.parallel.step_timeout_s
        deadline = time.monotonic() + timeout_s
        timer, channel = self.step_timer, self._step_leader
        if channel is not None:
            with timer.phase("fanout"):
                channel.run(steps, step_inputs, deadline, timeout_s)
        try:
            with timer.phase("forward"):
                logits = self.forward(steps)
            with timer.phase("after_step"):
                self.after_step(step_inputs)
        except Exception:
            # NOTE: a dead follower breaks the leader's collectives too: its own error wins.
            if channel is not None:
                channel.wait(deadline, timeout_s)
            raise
        if channel is not None:
            with timer.phase("follower_wait"):
                channel.wait(deadline, timeout_s)
        return logits

    def call_all(self, method: str, *args, timeout_s: float | None = None) -> list:
        """Call ``method(*args)`` on every rank (leader locally), bounded by ``timeout_s``
        (default ``step_timeout_s``); results in rank order.

        Raises:
            RankFailure: a follower died or did not answer in time.
            Exception: what the leader's call or a follower's (a ``RayTaskError``) raised.
        """
        bound = timeout_s or self.cfg.parallel.step_timeout_s
        deadline = time.monotonic() + bound
        refs = [getattr(p, method).remote(*args) for p in self.peers[1:]]
        leader_result = getattr(self, method)(*args)
        return [leader_result,
                *await_followers(refs, deadline - time.monotonic(), bound, method)]

    # ---- leader loop --------------------------------------------------------------------
    def start(self) -> None:
        """Leader: start the step loop thread."""
        self._loop_thread = threading.Thread(target=self._loop, name=f"{self.cfg.name}-loop",
                                             daemon=True)
        self._loop_thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._iterate():
                self._wake.wait(0.005)
                self._wake.clear()

    def _iterate(self) -> bool:
        """One loop iteration; never raises (an error ends requests, never the loop). True
        when it did work."""
        try:
            if self.broken is not None:
                if self.num_active():
                    self.fail_all(str(self.out_of_service()))
                return False
            started = time.perf_counter()
            try:
                return self.step()
            finally:
                self.step_timer.end_step(time.perf_counter() - started)
        except RankFailure as exc:
            self.mark_broken(str(exc))
            return True
        except Exception as exc:  # noqa: BLE001 - not a rank's failure: the step's requests
            log.exception("%s: step failed", self.cfg.name)
            try:
                self.fail_all(f"{self.cfg.name}: step failed: {exc}")
            except Exception:  # noqa: BLE001
                log.exception("%s: failing the requests of a failed step failed", self.cfg.name)
            return False

    def mark_broken(self, reason: str) -> None:
        """Take the instance out of service (the first reason stays); the loop then ends every
        request with an error, and new work is refused. Never blocks."""
        if self.broken is None:
            self.broken = reason
            log.error("%s is out of service: %s", self.cfg.name, reason)
        self._wake.set()

    def out_of_service(self) -> InstanceOutOfService:
        """The error new work gets while ``broken``."""
        return InstanceOutOfService(f"{self.cfg.name} is out of service: {self.broken} (orch "
                                    "restarts it)")

    def check_in_service(self) -> None:
        """Raises InstanceOutOfService while the instance is broken."""
        if self.broken is not None:
            raise self.out_of_service()

    @abstractmethod
    def step(self) -> bool:
        """Leader: one scheduling iteration; True when it did work."""

    @abstractmethod
    def fail_all(self, error: str) -> None:
        """Leader: end every request with an error event and free its blocks."""

    def emit(self, event: TokenEvent) -> None:
        self._events.put(event)

    def poll(self, timeout_s: float) -> list[TokenEvent]:
        """Router long-poll: events since the last poll; waits up to ``timeout_s`` for one."""
        out: list[TokenEvent] = []
        try:
            out.append(self._events.get(timeout=max(0.0, timeout_s)))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    @abstractmethod
    def status(self) -> InstanceStatusInfo:
        """Snapshot for ``orch status`` and metrics."""

    @abstractmethod
    def num_active(self) -> int:
        """Requests queued or running on this instance."""

    def drain(self, timeout_s: float) -> bool:
        """Wait (bounded) until no request is active; True when drained (at once when the
        role was never set up: an interrupted start-up)."""
        if not self._role_ready:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.num_active() == 0:
                return True
            time.sleep(0.05)
        return self.num_active() == 0

    def shutdown(self) -> None:
        """Stop the loop and release role resources (connectors) on this rank."""
        self._stop.set()
        self._wake.set()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=10)
        for channel in (self._step_leader, self._step_follower):
            if channel is not None:
                channel.close()
        if self._role_ready:
            self.close_role()

    def close_role(self) -> None:
        """Role hook, every rank, end of :meth:`shutdown` (the loop thread has stopped):
        release what :meth:`setup_role` opened (connectors, their threads and sockets)."""

    def process_info(self) -> tuple[str, str, int]:
        """(Ray node id, device, process id) of this rank."""
        return (*self.node_info(), os.getpid())

    def ranks_info(self, timeout_s: float | None = None
                   ) -> tuple[tuple[int, str, str, int], ...]:
        """(rank, node id, device, pid) of every rank, for status.

        Raises:
            RankFailure: a rank is gone or did not answer within ``timeout_s``.
        """
        return tuple((i, *info) for i, info in
                     enumerate(self.call_all("process_info", timeout_s=timeout_s)))

"""The rank actor: one Ray actor class for every role, holding a role object (rank/role.py).

A rank owns its TP group (a prefill instance with ``cp > 1``: its CP group, tp 1), with
``ep`` its end of the role's EP group, its model shard, its end of the step channel, and on
the leader the loop thread, the DP sync and the :class:`~rank.leader.Leader` state. Lifecycle
(driven by orchestrator/deploy/cluster.py): ``Rank(cfg, rank, role_cls)`` -> leader
``open_tp_store()`` (and, with ``ep``, the role's first leader ``open_ep_store()``) -> every
rank ``init_rank(host, port, peers, ep_store)`` (collective: rendezvous, model load, the role
built) -> leader ``start()`` -> ``open_events`` / ``request`` / ``status`` ... ->
``drain(timeout_s)`` -> ``shutdown()``. Only the leader schedules: each step goes to every rank (rank/spmd.py).

Failures: the loop thread (rank/loop.py) never ends on an error. A follower that is dead or
hung (:class:`RankFailure`) takes the instance out of service (rank/leader.py): the loop ends
every request with an error event and the leader refuses new work until orch replaces the
instance. Any other error of a step fails only the requests it concerns (rank/leader_step.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

import torch

from engine import envs
from rank.call_server import CallServer
from rank.config import InstanceConfig
from rank.dp_sync import DPSync
from rank.ep_setup import join_dp_sync, join_ep_group
from rank.failures import RankFailure, RankHung
from rank.leader import Leader
from rank.loop import StepLoop
from rank.messages import InstanceStatusInfo, LeaderRequest, TokenEvent
from rank.priority import raise_priority
from rank.role import RankParts, Role
from rank.spmd import SPMDGroup, StepSync
from rank.status_report import StatusReporter
from rank.step_channel import (StepChannelFollower, StepChannelLeader, connect_follower,
                               open_leader)
from rank.step_timing import StepTimer

T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Seconds a status snapshot waits for the other ranks (status answers within a few seconds
# even when a rank hangs).
STATUS_TIMEOUT_S = 2.0


class Rank:
    """One rank actor (a plain class; Ray wraps it, orchestrator/deploy/cluster.py).

    Args:
        cfg: the instance's config.
        rank: this actor's TP (or CP) rank (0 = leader).
        role: the role class (``PrefillRole``, ``DecodeRole``, ``ColocatedRole``), built on
            this rank once the model is loaded.
    """

    def __init__(self, cfg: InstanceConfig, rank: int, role: type[Role]) -> None:
        self.cfg, self.rank, self.role_cls = cfg, rank, role
        self.role: Role | None = None  # built by init_rank
        self.leader: Leader | None = None  # rank 0, built by init_rank
        self.runner = None
        self.peers: list = []
        self._store = None
        self._ep_store = None  # the role's EP store, on the leader that opened it
        self.dp_sync: DPSync | None = None  # leader of an EP role with dp > 1
        self.loop: StepLoop | None = None  # leader, from start()
        self._step_leader: StepChannelLeader | None = None  # leader with followers
        self._step_follower: StepChannelFollower | None = None  # a follower
        self.step_timer = StepTimer()  # leader: where step time goes
        self._reporter: StatusReporter | None = None  # leader, once a router asks for reports
        self._calls: CallServer | None = None  # leader, from start(): calls over TCP
        if not cfg.parallel.bind_host:  # multi-node: listen on this node's address
            import ray

            self.cfg = cfg = replace(cfg, parallel=replace(
                cfg.parallel, bind_host=ray.util.get_node_ip_address()))
        if cfg.parallel.bind_host == "127.0.0.1":
            # NOTE: keep Gloo's sockets on loopback too (it otherwise resolves the hostname).
            envs.GLOO_SOCKET_IFNAME.set_default("lo")
        torch.set_num_threads(envs.ORCH_TORCH_THREADS.get())
        raise_priority()  # NOTE: Ray starts workers at nice 15 (rank/priority.py)

    def __repr__(self) -> str:
        # NOTE: Ray shows this as the actor's name (log prefixes, `ray list actors`,
        # ray.util.state's repr_name), so a rank is found as "decode-0:1".
        return f"{self.cfg.name}:{self.rank}"

    # ---- bring-up -----------------------------------------------------------------------
    def node_info(self) -> tuple[str, str]:
        """(Ray node id, device) of this rank; the health probe (its own Ray thread)."""
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        return node, self.cfg.parallel.device

    def process_info(self) -> tuple[str, str, int]:
        """(Ray node id, device, process id) of this rank."""
        return (*self.node_info(), os.getpid())

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
        leader the DP sync), load the model shard, build the role. Collective.

        Raises:
            RuntimeError: rendezvous or model load failed (message names instance and rank).
        """
        from engine.parallel import init_cp_group, init_tp_group
        from engine.runner import build_runner

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
            # NOTE: DeepSeek-V4 checkpoints get engine.v4's runner (engine.runner.build_runner)
            self.runner = build_runner(self.cfg.checkpoint_dir,
                                       num_kv_blocks=self.cfg.scheduler.num_kv_blocks,
                                       block_size=self.cfg.scheduler.block_size,
                                       dtype=_DTYPES[self.cfg.dtype], tp=tp, device=device,
                                       ep=ep, fp8_storage=self.cfg.fp8_storage, cp=cp,
                                       layer_sharding=par.layer_sharding, graph=self.cfg.graph,
                                       prefill_graph=self.cfg.prefill_graph,
                                       num_speculative_tokens=(
                                           self.cfg.scheduler.num_speculative_tokens),
                                       prefix_cache=self.cfg.scheduler.prefix_cache,
                                       staging_blocks=(0 if self.cfg.role == "colocated" else
                                                       self.cfg.scheduler.staging_blocks),
                                       v4_shape=self.cfg.scheduler.v4_shape)
            if ep is not None and self.rank == 0:
                self.dp_sync = join_dp_sync(par, ep_store, self.cfg.transfer.connect_timeout_s,
                                            store=self._ep_store)
        except Exception as exc:
            raise RuntimeError(f"{self.cfg.name} rank {self.rank}: init failed: {exc}") from exc
        self.setup_role()
        if par.ranks > 1:
            self._join_step_channel(host, port)

    def setup_role(self) -> None:
        """End of :meth:`init_rank` (``runner`` and ``dp_sync`` exist, the loop is not
        started): on the leader the :class:`Leader` over the instance's ranks, then the
        role."""
        if self.rank == 0:
            group = SPMDGroup(self, self.peers, self._step_leader, self.step_timer,
                              self.cfg.parallel.step_timeout_s)
            self.leader = Leader(self.cfg, self.role_cls.policy, self.role_cls.source,
                                 self.runner.model_config.eos_token_ids, group, self.dp_sync,
                                 num_blocks=getattr(self.runner, "scheduler_blocks", None))
            if hasattr(self.runner, "release"):  # NOTE: V4: its blocks follow the pool's
                self.leader.pool.on_free = self.runner.release
                # NOTE: V4 admits by its per-group blocks (engine/v4/admission.py)
                self.leader.scheduler.admission = self.runner.make_admission(
                    self.cfg.scheduler.block_size, staged=self.cfg.role != "colocated")
        self.role = self.role_cls(RankParts(self.cfg, self.rank, self.runner, self.leader))

    def _join_step_channel(self, host: str, port: int) -> None:
        """End of :meth:`init_rank` (the role exists): a follower connects to the leader's
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

    # ---- every rank: the SPMD step and rank-to-rank calls -------------------------------
    def forward(self, steps: list, step_inputs: Any = None) -> torch.Tensor | None:
        """This rank's model forward of one step: ``[B, V]`` logits, None for no steps.
        The role's :meth:`Role.layer_hook` of ``step_inputs`` (the leader's, as
        ``after_step`` gets them) is called after each layer's KV write.

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
        hook = self.role.layer_hook(step_inputs)
        try:
            return self.runner.execute(steps) if hook is None else \
                self.runner.execute(steps, hook)
        except ValueError:
            if ep:
                self.runner.execute_empty()
            raise

    def after_step(self, step_inputs: Any, output: Any = None) -> None:
        """The role's :meth:`Role.after_step` of this rank (``output``: its forward's)."""
        self.role.after_step(step_inputs, output)

    def execute_step(self, steps: list, step_inputs: Any = None) -> None:
        """Follower side of one step (on the step channel's thread): free what the leader's
        runner released (a :class:`rank.spmd.StepSync` frame), run the model on ``steps``,
        then the role's ``after_step`` with the leader's ``step_inputs``."""
        if isinstance(step_inputs, StepSync):
            self.free_released(step_inputs.released)
            step_inputs = step_inputs.step_inputs
        self.after_step(step_inputs, self.forward(steps, step_inputs))

    def take_releases(self) -> tuple[str, ...]:
        """Leader of several ranks: the request ids its runner released since the last call
        (DeepSeek-V4: :meth:`engine.v4.runner.V4Runner.take_releases`), which every rank frees
        (:meth:`free_released`); () otherwise (one rank: the runner frees them itself)."""
        take = getattr(self.runner, "take_releases", None)
        if take is None or self.cfg.parallel.ranks == 1:
            return ()
        return take()

    def free_released(self, released: tuple[str, ...]) -> None:
        """Free the caches of the leader's ``released`` requests on this rank (no-op for ()).
        Also a follower's actor call (:meth:`rank.spmd.SPMDGroup.free_released`)."""
        if released:
            self.runner.free_requests(released)

    def free_idle_releases(self) -> None:
        """Leader, its loop idle (an iteration without a step; the loop thread, so no step
        or rank-to-rank call runs meanwhile): what the runner released since the last step
        is freed now on every rank, not at the next step, which an idle instance never
        takes, so its pools (``status().kv_groups``) read free once its requests ended.
        DeepSeek-V4 only (no-op otherwise); tp 1: the runner's own
        :meth:`~engine.v4.runner.V4Runner.apply_releases`; several ranks:
        :meth:`rank.spmd.SPMDGroup.free_released`. Each released request is freed once per
        rank (taken once: no later step or rebuild sees it).

        Raises:
            RankFailure: a follower died or did not answer within the step bound.
        """
        apply = getattr(self.runner, "apply_releases", None)
        if apply is None:
            return
        if self.cfg.parallel.ranks == 1:
            apply()
        else:
            self.leader.ranks.free_released()

    def role_call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(role, *args)``: a rank-to-rank call (``SPMDGroup.call_all``); ``fn`` is a
        method of this rank's role class."""
        return fn(self.role, *args)

    # ---- leader ------------------------------------------------------------------------
    def start(self) -> None:
        """Leader: the role's start, then the step loop thread (rank/loop.py).

        Raises:
            RankFailure: a rank is gone or did not answer the role's start.
        """
        self.role.start()
        self._calls = CallServer(self.cfg.name, self.cfg.parallel.bind_host or "127.0.0.1",
                                 self.request)
        self.loop = StepLoop(self.cfg.name, self.leader, self.role,
                             on_idle=self.free_idle_releases)
        self.loop.start()

    def start_alone(self) -> None:
        """An instance of this one rank (tp 1, in this process: tests and benchmarks): its TP
        store, :meth:`init_rank` with itself as the only peer, then :meth:`start`.

        Raises:
            as :meth:`init_rank` and :meth:`start`.
        """
        host, port = self.open_tp_store()
        self.init_rank(host, port, [self])
        self.start()

    def request(self, request: LeaderRequest) -> Any:
        """Leader: one router request (rank/messages.py), handled by the role; its answer.

        Raises:
            InstanceOutOfService: new work while the instance is out of service.
            TypeError: a request this instance's role does not take.
        """
        return self.role.handle(request)

    def open_calls(self) -> tuple[str, int, bytes]:
        """Leader: where a router sends its :meth:`request` calls over TCP instead of Ray
        (``router.leader_calls: socket``, rank/call_server.py); (host, port, token).

        Raises:
            RuntimeError: not started, or shutting down.
        """
        if self._calls is None:
            raise RuntimeError(f"{self.cfg.name}: leader calls are served once it started")
        raise_priority()  # NOTE: the server's threads inherit this thread's nice value
        return self._calls.open()

    def poll(self, timeout_s: float, kv_events: bool = False) -> list[TokenEvent]:
        """Events since the last poll, while no router subscribed (tests drive a rank this
        way); waits up to ``timeout_s`` for one (``kv_events``: see
        :meth:`rank.leader.Leader.poll`)."""
        return self.leader.poll(timeout_s, kv_events)

    def open_events(self, subscriber: str, beat_s: float | None = None,
                    status_s: float | None = None) -> tuple[str, int, bytes, str]:
        """Leader: where router ``subscriber`` follows the token stream (rank/event_stream.py);
        (host, port, token, epoch). ``beat_s``: a frame at least this often (seconds);
        ``status_s``: a :meth:`status` report on the stream this often (rank/status_report.py)."""
        address = self.leader.open_events(subscriber, beat_s)
        if status_s is not None:
            if self._reporter is None:
                self._reporter = StatusReporter(self.cfg.name, self.leader, self.status)
            self._reporter.every(status_s)
        return address

    def status(self) -> InstanceStatusInfo:
        """Snapshot for ``orch status`` and metrics, within a few seconds whatever the ranks
        do (each call to the ranks is bounded by ``STATUS_TIMEOUT_S``).

        Asks every rank (bounded): a dead one takes the instance out of service (``broken``);
        one that does not answer in time is reported by a TimeoutError (the step deadline or
        the router's health checks judge whether it hangs). A DeepSeek-V4 runner's group pools
        go in ``kv_groups`` (:meth:`engine.v4.runner.V4Runner.group_blocks`), the runner's
        graph modes in ``graph_modes`` (:meth:`engine.runner.ModelRunner.graph_modes`).

        Raises:
            TimeoutError: a rank did not answer within ``STATUS_TIMEOUT_S``.
        """
        leader = self.leader
        try:
            ranks = leader.ranks.ranks_info(timeout_s=STATUS_TIMEOUT_S)
            fields = self.role.status_fields(STATUS_TIMEOUT_S)
        except RankHung as exc:
            raise TimeoutError(f"{self.cfg.name}: {exc}") from exc
        except RankFailure as exc:
            leader.mark_broken(str(exc))
            ranks, fields = (), self.role.status_fields(None)
        group_blocks = getattr(self.runner, "group_blocks", None)  # NOTE: DeepSeek-V4's pools
        if group_blocks is not None:
            fields = {**fields, "kv_groups": group_blocks()}
        graph_modes = getattr(self.runner, "graph_modes", None)  # NOTE: not V4's runner
        if graph_modes is not None:
            fields = {**fields, "graph_modes": graph_modes()}
        return leader.status(ranks, fields)

    # ---- tear-down ----------------------------------------------------------------------
    def drain(self, timeout_s: float) -> bool:
        """Wait (bounded) until no request is active; True when drained (at once when the
        role was never built: an interrupted start-up)."""
        if self.role is None:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.role.num_active() == 0:
                return True
            time.sleep(0.05)
        return self.role.num_active() == 0

    def shutdown(self) -> None:
        """Stop the loop and release the role's resources (connectors) on this rank."""
        if self._calls is not None:
            self._calls.close()
        if self._reporter is not None:
            self._reporter.stop()
        if self.loop is not None:
            self.loop.stop()
        if self.leader is not None:
            self.leader.close()
        for channel in (self._step_leader, self._step_follower):
            if channel is not None:
                channel.close()
        if self.role is not None:
            self.role.close()

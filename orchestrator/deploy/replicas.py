"""Router replicas (``router.replicas: N``): N router processes on the same gRPC and HTTP ports.

`orch up`'s own router is replica 0: it alone probes health, restarts instances, serves Admin
(`orch scale`) and the metrics endpoint. Replicas 1..N-1 are Ray actors (:class:`RouterReplica`,
no CPU reserved, on `orch up`'s node) each running a whole :class:`Router` with its own
:class:`OrchServer` and HTTP server bound with ``SO_REUSEPORT`` to replica 0's ports, so the
kernel spreads client connections over the N processes. Each replica:

- gets the leader actor handles at spawn and follows every leader's token stream itself (its own
  ``EventStream`` subscriber id; the pump keeps the events of its own attempts, whose ids are
  unique across replicas);
- places with views the instances report on those streams (decode free blocks wake its admission
  queue, KV events feed its ``kv_aware`` index), so no view is shared between processes; its
  ``outstanding`` load counts only its own requests;
- mirrors replica 0's health (:class:`HealthMirror`, pushed on every change with the leaders'
  current handles, so a restarted instance is rebound);
- asks the others over the peer channel (orchestrator/router/peers.py) to abort a request it
  does not run, and forwards its metrics reports to replica 0.

Replicas do not follow instances added or removed live, so with N > 1 every replica refuses
Admin (:class:`NoLiveScaling`) and the config refuses ``autoscale``; a replica that dies is not
restarted.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from orchestrator.api.rpc import orch_pb2_grpc as pb_grpc
from orchestrator.config.checkpoint import ModelInfo
from orchestrator.config.schema import OrchConfig
from orchestrator.deploy.assemble import build_board, build_http_server, build_router
from orchestrator.deploy.background import Background
from orchestrator.deploy.health import HealthMonitor
from orchestrator.deploy.health_mirror import HealthMirror, health_rows
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.router.peers import (ForwardedMetrics, PeerAddress, PeerClient, Peers,
                                       PeerServer, metrics_op)
from orchestrator.router.router import Router
from orchestrator.api.security import EdgeSecurity
from orchestrator.api.server import OrchServer

log = logging.getLogger(__name__)
SCALING_REFUSED = ("live scaling needs router.replicas: 1 (router replicas do not follow "
                   "instances added or removed live): change the config and restart orch up")
START_TIMEOUT_S = 120.0  # a replica's start (its process, tokenizer, servers)
STOP_SLACK_S = 10.0  # beyond the drain bound, for a replica's stop


@dataclass(frozen=True)
class ReplicaSpec:
    """What replica ``index`` is built from (sent to it once, at spawn).

    ``cfg.router.port`` / ``http_port`` are the ports replica 0 bound; ``secret`` is the
    peer channel's; ``main`` replica 0's peer address; ``rows`` its health now; ``metrics``:
    whether replica 0 keeps metrics (then reports are forwarded)."""

    cfg: OrchConfig
    index: int
    handles: dict[str, Any]
    model: ModelInfo
    checkpoint: str
    security: EdgeSecurity
    secret: bytes
    main: PeerAddress
    rows: list
    metrics: bool
    drain_s: float


class RouterReplica:
    """One router replica process (a Ray actor; every method runs on its event loop)."""

    async def start(self, spec: ReplicaSpec) -> PeerAddress:
        """Build the router and its servers on replica 0's ports; returns its peer address.

        Raises:
            PortInUseError: the ports could not be shared (replica 0 did not set SO_REUSEPORT).
        """
        cfg, checkpoint = spec.cfg, Path(spec.checkpoint)
        self.main = PeerClient(spec.main, spec.secret)
        self.health = HealthMirror(spec.rows, self.main, cfg.health.probe_interval_s,
                                   on_unhealthy=lambda name, why:
                                   self.router.fleet.instance_failed(name, why))
        self.metrics = ForwardedMetrics(self.main) if spec.metrics else None
        tokenizer = Tokenizer(checkpoint) if (checkpoint / "tokenizer.json").is_file() else None
        self.router = build_router(cfg, spec.handles, spec.model, tokenizer, self.metrics,
                                   health=self.health, replica=spec.index)
        self.peers = Peers()
        self.server = OrchServer(self.router, build_board(cfg, self.router, self.health),
                                 cfg.router.host, cfg.router.port, spec.security,
                                 cfg.router.max_message_bytes, admin=NoLiveScaling(),
                                 peers=self.peers, reuse_port=True)
        self.secret, self.drain_s = spec.secret, spec.drain_s
        await self.server.start()
        self.http = None
        if cfg.router.http_port is not None:
            self.http = build_http_server(cfg, self.router, checkpoint, spec.security.token,
                                          ready=lambda: self.server.serving,
                                          grace_s=spec.drain_s,
                                          retry_after=self.health.retry_after_s,
                                          reuse_port=True)
            await self.http.start()
        self.peer_server = PeerServer({"abort": self.router.abort}, spec.secret)
        return await self.peer_server.start()

    async def set_peers(self, addresses: list[PeerAddress]) -> None:
        """The other replicas' peer addresses (replica 0's among them)."""
        self.peers.clients = [PeerClient(a, self.secret) for a in addresses]

    async def update(self, rows: list, handles: dict[str, Any]) -> None:
        """Replica 0's health now and the leaders' current handles (a restarted instance's
        new leader is followed from now on)."""
        for leader in self.router.flow.leaders:
            new = handles.get(leader.name)
            if new is not None and _actor_id(new) != _actor_id(leader.handle):
                leader.rebind(new)
        self.health.apply(rows)

    async def stop(self) -> None:
        """Drain and stop as `orch up` does (health NOT_SERVING, requests end, servers stop)."""
        stops = [self.server.stop(grace_s=self.drain_s)] + ([self.http.stop()]
                                                              if self.http else [])
        await asyncio.gather(*stops)
        await self.peer_server.stop()
        self.peers.close()
        if self.metrics is not None:
            await self.metrics.stop()
        self.main.close()


class NoLiveScaling(pb_grpc.AdminServicer):
    """Admin of every replica when ``router.replicas`` > 1: live scaling is refused (the
    replicas would not follow it), with what to do instead."""

    async def _refuse(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, SCALING_REFUSED)

    Scale = AddInstance = RemoveInstance = _refuse


def _actor_id(handle: Any) -> Any:
    return getattr(handle, "_actor_id", handle)  # NOTE: Ray handles are new objects per call


class ReplicaSet:
    """Replica 0's side: spawns replicas 1..N-1, keeps them told, stops them.

    Args:
        router, monitor: replica 0's router and health monitor.
        leaders: ``() -> {instance name: leader handle}`` now (``Cluster.leaders``).
        peers: replica 0's :class:`Peers` (filled here: its Abort asks the replicas).
        spawn, kill: start a :class:`RouterReplica` (whose methods are called as
            ``method.remote(...)``, awaitable) and end it; default: a Ray actor on this node.
    """

    def __init__(self, router: Router, monitor: HealthMonitor, leaders, peers: Peers,
                 spawn: Callable[[], Any] | None = None,
                 kill: Callable[[Any], None] | None = None) -> None:
        self.router, self.monitor, self.leaders, self.peers = router, monitor, leaders, peers
        self._spawn, self._kill = spawn or _spawn_actor, kill or _kill_actor
        self._updates = Background("a health update to a router replica")
        self.secret = secrets.token_bytes(16)
        self.actors: list[Any] = []
        self.peer_server = PeerServer({"abort": router.abort, "probe": monitor.probe,
                                       "failure": monitor.report_failure,
                                       "metrics": metrics_op(router.metrics)}, self.secret)

    async def start(self, cfg: OrchConfig, model: ModelInfo, checkpoint: Path,
                    security: EdgeSecurity, has_metrics: bool, drain_s: float) -> None:
        """Spawn ``cfg.router.replicas - 1`` replicas on ``cfg.router``'s (bound) ports and
        wait until they serve (bounded by :data:`START_TIMEOUT_S`).

        Raises:
            RuntimeError: a replica did not start (its error).
        """
        main = await self.peer_server.start()
        self.actors = [self._spawn() for _ in range(cfg.router.replicas - 1)]
        specs = [ReplicaSpec(cfg, i + 1, self.leaders(), model, str(checkpoint), security,
                             self.secret, main, health_rows(self.monitor), has_metrics,
                             drain_s) for i in range(len(self.actors))]
        addresses = await asyncio.wait_for(asyncio.gather(
            *(actor.start.remote(spec) for actor, spec in zip(self.actors, specs))),
            START_TIMEOUT_S)
        for i, actor in enumerate(self.actors):
            await actor.set_peers.remote([main] + addresses[:i] + addresses[i + 1:])
        self.peers.clients = [PeerClient(a, self.secret) for a in addresses]
        self.monitor.add_listener(self._changed)
        self._changed(None)  # NOTE: what changed while they started

    def _changed(self, _health) -> None:
        rows, handles = health_rows(self.monitor), self.leaders()
        for actor in self.actors:
            # NOTE: in order per actor (Ray's actor queue; update never awaits)
            self._updates.start(_resolve(actor.update.remote(rows, handles)))

    async def stop(self, drain_s: float) -> None:
        """Drain and stop every replica (bounded), then end their processes."""
        self.monitor.remove_listener(self._changed)
        if self.actors:
            done = asyncio.gather(*(actor.stop.remote() for actor in self.actors),
                                  return_exceptions=True)
            try:
                await asyncio.wait_for(done, drain_s + STOP_SLACK_S)
            except asyncio.TimeoutError:
                log.warning("router replicas did not stop within %.0f s", drain_s + STOP_SLACK_S)
        for actor in self.actors:
            self._kill(actor)
        self.peers.close()
        await self.peer_server.stop()


async def _resolve(ref: Any) -> Any:
    return await ref


def _spawn_actor() -> Any:
    """A :class:`RouterReplica` Ray actor on this node (its ports are this node's), no CPU
    reserved (it is not a rank)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(RouterReplica).options(scheduling_strategy=here).remote()


def _kill_actor(actor: Any) -> None:
    import ray

    ray.kill(actor, no_restart=True)

"""Ray bring-up and tear-down of the rank actors of every instance.

Sequence (every step bounded by ``cluster.startup_timeout_s``; any failure names the
instance/rank, tears everything down and raises :class:`BringUpError`):

1. one placement group per instance (STRICT_PACK, one bundle per rank), wait until ready;
2. create the rank actors ``cls(cfg: InstanceConfig, rank)`` in their bundles, check
   ``node_info()`` on each (constructor errors surface here);
3. ``host, port = leader.open_tp_store()``;
4. ``rank.init_rank(host, port, peers)`` on every rank (``peers``: all rank handles of the
   instance, rank order);
5. ``leader.start()``.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from prefill_worker.config import InstanceConfig
from orchestrator.config import OrchConfig
from orchestrator.placement import STRATEGY, rank_bundle, role_resources

log = logging.getLogger(__name__)

RANK_CLASSES = {
    "prefill": "prefill_worker.actor:PrefillRank",
    "decode": "decode_worker.actor:DecodeRank",
    "colocated": "prefill_worker.colocated:ColocatedRank",
}
ACTOR_CONCURRENCY = 16  # NOTE: poll() blocks a thread while reserve/abort/status still answer
SHUTDOWN_TIMEOUT_S = 30.0


class BringUpError(RuntimeError):
    """The cluster could not be brought up; the message names the instance/rank and the fix."""


@dataclass
class InstanceRanks:
    """One running instance: its config, placement group and rank actors (rank order)."""

    cfg: InstanceConfig
    pg: Any
    ranks: list[Any] = field(default_factory=list)
    nodes: list[tuple[str, str]] = field(default_factory=list)  # (node id, device) per rank

    @property
    def leader(self) -> Any:
        return self.ranks[0]


@dataclass
class Cluster:
    """Everything :func:`bring_up` made; :meth:`teardown` undoes it exactly once."""

    instances: list[InstanceRanks]
    started_ray: bool

    def leaders(self) -> dict[str, Any]:
        """Instance name -> leader actor handle."""
        return {inst.cfg.name: inst.leader for inst in self.instances}

    def teardown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Leaders ``drain`` then ``shutdown`` (each bounded by ``timeout_s``), kill every rank,
        remove the placement groups, stop Ray if we started it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        leaders = [inst.leader for inst in self.instances if inst.ranks]
        for step, args in (("drain", (timeout_s,)), ("shutdown", ())):
            try:
                ray.get([getattr(leader, step).remote(*args) for leader in leaders],
                        timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 -- tear-down goes on whatever happened
                log.warning("leader %s did not complete: %s", step, exc)
        for inst in self.instances:
            for actor in inst.ranks:
                ray.kill(actor)
            remove_placement_group(inst.pg)
        self.instances = []
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False


def connect_ray(cfg: OrchConfig) -> bool:
    """Join ``cluster.address`` or start an embedded private Ray; True when we started it.

    The embedded Ray is always a new local cluster of this process (``address="local"``,
    ``RAY_ADDRESS`` removed from the environment), never one already running on the host.

    Raises:
        BringUpError: the cluster is unreachable or refuses this process (one line: what to
            do).
    """
    import ray

    from engine import envs

    if ray.is_initialized():
        return False
    if cfg.cluster.address:
        _check_reachable(cfg.cluster.address, timeout_s=10.0)
        ray.init(address=cfg.cluster.address)
        return False
    resources = {}
    if cfg.device() == "npu":
        import torch
        import torch_npu  # noqa: F401

        resources["NPU"] = torch.npu.device_count()
    envs.RAY_ADDRESS.unset()
    ray.init(address="local", num_cpus=os.cpu_count(), resources=resources or None,
             include_dashboard=False)
    return True


def _check_reachable(address: str, timeout_s: float) -> None:
    """Fail fast (bounded) when ``host:port`` of a Ray cluster does not accept connections
    or refuses this process's authentication token.

    Raises:
        BringUpError: nothing listens there within ``timeout_s`` seconds, or the cluster
            requires a token this process does not present.
    """
    import socket

    import ray
    from ray._raylet import GcsClient  # NOTE: the one Ray client that fails in ms, typed

    if address == "auto" or "://" in address or ":" not in address:
        return  # ray resolves these itself
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as exc:
        raise BringUpError(
            f"cannot reach the Ray cluster at cluster.address {address!r} within {timeout_s:g} s "
            f"({exc}): start it with `ray start --head` on that node, or fix the address "
            "(empty = embedded local Ray)") from None
    try:
        GcsClient(address=address)
    except ray.exceptions.AuthenticationError:
        raise BringUpError(
            f"the Ray cluster at {address} refused this process's token (InvalidAuthToken): "
            "run `orch up` with RAY_AUTH_MODE=token and the cluster's token (the head's "
            "~/.ray/auth_token, or RAY_AUTH_TOKEN), as in the README's multi-node recipe") from None
    except ray.exceptions.RpcError as exc:
        raise BringUpError(
            f"{address} accepts connections but no Ray cluster answered there ({exc}): give "
            "cluster.address as the head's IP and `ray start --head --port`") from None


def load_rank_classes() -> dict[str, type]:
    """The lead's rank actor classes (imported lazily; clear error when absent)."""
    classes = {}
    for role, target in RANK_CLASSES.items():
        module, name = target.split(":")
        try:
            classes[role] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise BringUpError(f"cannot import {target} ({exc}): this build lacks the "
                               f"{role} worker; install the full orch package") from None
    return classes


def bring_up(cfg: OrchConfig, rank_classes: dict[str, type] | None = None,
             started_ray: bool = False) -> Cluster:
    """Create and start every instance of ``cfg`` on the connected Ray cluster.

    Args:
        cfg: the deployment.
        rank_classes: role -> plain rank class (default: :func:`load_rank_classes`).
        started_ray: whether the caller started Ray (then teardown stops it).

    Raises:
        BringUpError: a placement group, actor or init step failed or timed out.
    """
    classes = rank_classes or load_rank_classes()
    cluster = Cluster(instances=[], started_ray=started_ray)
    timeout = cfg.cluster.startup_timeout_s
    try:
        for inst_cfg in cfg.instances():
            cluster.instances.append(_placement_group(inst_cfg, cfg, timeout))
        for inst in cluster.instances:
            _create_ranks(inst, classes[inst.cfg.role], cfg.cluster.cpus_per_rank)
        for inst in cluster.instances:
            inst.nodes = _get_ranks(inst, [r.node_info.remote() for r in inst.ranks],
                                    "node_info", timeout)
        stores = [_get_one(inst, inst.leader.open_tp_store.remote(), "open_tp_store", timeout)
                  for inst in cluster.instances]
        inits = [[r.init_rank.remote(host, port, inst.ranks) for r in inst.ranks]
                 for inst, (host, port) in zip(cluster.instances, stores)]
        for inst, refs in zip(cluster.instances, inits):
            _get_ranks(inst, refs, "init_rank", timeout)
        for inst in cluster.instances:
            _get_one(inst, inst.leader.start.remote(), "start", timeout)
    except BaseException:
        cluster.teardown()
        raise
    for inst in cluster.instances:
        log.info("%s up: %s", inst.cfg.name, inst.nodes)
    return cluster


def _placement_group(inst: InstanceConfig, cfg: OrchConfig, timeout: float) -> InstanceRanks:
    import ray
    from ray.util.placement_group import placement_group

    bundle = rank_bundle(inst.parallel.device, cfg.cluster.cpus_per_rank,
                         role_resources(cfg, inst.role))
    pg = placement_group([dict(bundle) for _ in range(inst.parallel.tp)], strategy=STRATEGY,
                         name=f"orch-{inst.name}")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise BringUpError(
            f"{inst.name}: placement group of {inst.parallel.tp} x {bundle} ({STRATEGY}: all "
            f"on one node) not ready within {timeout:g} s: no node has those resources free (see "
            "`ray status`); lower cluster.cpus_per_rank or the tp, or add nodes") from None
    return InstanceRanks(cfg=inst, pg=pg)


def _create_ranks(inst: InstanceRanks, cls: type, cpus: float) -> None:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    accel = {"cuda": {"num_gpus": 1},
             "npu": {"resources": {"NPU": 1}}}.get(inst.cfg.parallel.device, {})
    remote_cls = ray.remote(cls)
    for rank in range(inst.cfg.parallel.tp):
        strategy = PlacementGroupSchedulingStrategy(placement_group=inst.pg,
                                                    placement_group_bundle_index=rank)
        options = dict(num_cpus=cpus, scheduling_strategy=strategy,
                       max_concurrency=ACTOR_CONCURRENCY, **accel)
        inst.ranks.append(remote_cls.options(**options).remote(inst.cfg, rank))


def _get_one(inst: InstanceRanks, ref: Any, step: str, timeout: float) -> Any:
    return _get_ranks(inst, [ref], step, timeout)[0]


def _get_ranks(inst: InstanceRanks, refs: list[Any], step: str, timeout: float) -> list[Any]:
    """``ray.get`` each rank's ``step`` result; failures name the instance and rank."""
    import time

    import ray

    out, deadline = [], time.monotonic() + timeout
    for rank, ref in enumerate(refs):
        try:
            out.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.01)))
        except ray.exceptions.GetTimeoutError:
            raise BringUpError(f"{inst.cfg.name} rank {rank}: {step} did not finish within "
                               f"cluster.startup_timeout_s={timeout:g} s; see that rank's log "
                               "(ray logs), or raise the timeout") from None
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc  # the worker's own exception
            raise BringUpError(f"{inst.cfg.name} rank {rank}: {step} failed: "
                               f"{type(cause).__name__}: {cause} (traceback in that rank's "
                               "log: `ray logs`)") from None
    return out

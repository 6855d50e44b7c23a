"""The rank actors of one instance: placement group, creation, start, stop, kill.

What :mod:`orchestrator.deploy.cluster` does at bring-up, restart, live scaling and tear-down
is made of these steps (its module docstring lists them in order); each Ray wait is bounded
and a failure names the instance and rank (:class:`BringUpError`).
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine.error_text import first_line
from rank.config import InstanceConfig
from orchestrator.config.schema import OrchConfig
from orchestrator.config.sections import ClusterSection
from orchestrator.deploy.health import PROBE_GROUP
from orchestrator.deploy.placement import STRATEGY, rank_bundle, role_resources

log = logging.getLogger(__name__)

# NOTE: the rank package never imports the workers: the role class of an instance is picked
# here by ``InstanceConfig.role`` and handed to its ranks (pickled by reference).
ROLES = {
    "prefill": "prefill_worker.role:PrefillRole",
    "decode": "decode_worker.role:DecodeRole",
    "colocated": "rank.colocated:ColocatedRole",
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
    started: bool = False  # the leader's start() returned: there is work to drain
    group: str = ""  # the EP group (expert-parallel role) it belongs to: "" the first one

    @property
    def leader(self) -> Any:
        return self.ranks[0]


def stop_leaders(insts: list[InstanceRanks], timeout_s: float) -> None:
    """Every leader's ``drain``, then every leader's ``shutdown``, each stage bounded by
    ``timeout_s``; failures are logged (stopping goes on whatever happened)."""
    import ray

    leaders = [inst.leader for inst in insts]
    stages = (("drain", lambda leader: leader.drain.remote(timeout_s)),
              ("shutdown", lambda leader: leader.shutdown.remote()))
    for step, call in stages:
        if not leaders:
            return
        try:
            ray.get([call(leader) for leader in leaders], timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 -- stopping goes on whatever happened
            worker_error = getattr(exc, "cause", None) or exc  # RayTaskError wraps it
            log.warning("%s: leader %s did not complete: %s",
                        ", ".join(i.cfg.name for i in insts), step, first_line(worker_error))
            log.debug("leader %s failure detail", step, exc_info=exc)


def load_roles() -> dict[str, type]:
    """Role name -> role class (:data:`ROLES`, imported lazily; clear error when absent)."""
    roles = {}
    for role, target in ROLES.items():
        module, name = target.split(":")
        try:
            roles[role] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise BringUpError(f"cannot import {target} ({exc}): this build lacks the "
                               f"{role} worker; install the full orch package") from None
    return roles


def open_ep_stores(instances: list[InstanceRanks], timeout: float) -> dict[str, tuple]:
    """Role -> (host, port) of its EP store, opened by the leader of the role's first
    instance (EP rank 0), for every role with ``ep``.

    Raises:
        BringUpError: that leader did not open it within ``timeout``.
    """
    stores: dict[str, tuple] = {}
    for inst in instances:
        if inst.cfg.parallel.ep and inst.cfg.parallel.dp_rank == 0:
            stores[inst.cfg.role] = get_one(inst, inst.leader.open_ep_store.remote(),
                                             "open_ep_store", timeout)
    return stores


def start_instances(insts: list[InstanceRanks], cls: type, role: type, res: ClusterSection,
                     deadline: float) -> None:
    """Steps 2-5 of the module docstring for instances (of one role) whose placement groups
    are ready, each step bounded by what is left until ``deadline`` (monotonic seconds).

    Raises:
        BringUpError: a step failed or did not finish in time.
    """
    def left() -> float:
        return max(deadline - time.monotonic(), 0.01)

    for inst in insts:
        create_ranks(inst, cls, role, res)
    for inst in insts:
        inst.nodes = get_ranks(inst, [r.node_info.remote() for r in inst.ranks], "node_info",
                                left())
    stores = [get_one(inst, inst.leader.open_tp_store.remote(), "open_tp_store", left())
              for inst in insts]
    ep_stores = open_ep_stores(insts, left())
    inits = [[r.init_rank.remote(host, port, inst.ranks, ep_stores.get(inst.cfg.role))
              for r in inst.ranks] for inst, (host, port) in zip(insts, stores)]
    for inst, refs in zip(insts, inits):
        get_ranks(inst, refs, "init_rank", left())
    for inst in insts:
        get_one(inst, inst.leader.start.remote(), "start", left())
        inst.started = True


def kill_instance(inst: InstanceRanks) -> None:
    """Kill the instance's rank actors and remove its placement group (errors logged)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for actor in inst.ranks:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 -- already gone
            log.debug("%s: kill: %s", inst.cfg.name, exc)
    if inst.pg is not None:
        try:
            remove_placement_group(inst.pg)
        except Exception as exc:  # noqa: BLE001 -- already removed
            log.debug("%s: remove placement group: %s", inst.cfg.name, exc)


def placement_group_for(inst: InstanceConfig, cfg: OrchConfig, timeout: float) -> InstanceRanks:
    import ray
    from ray.util.placement_group import placement_group

    bundle = rank_bundle(inst.parallel.device, cfg.cluster, role_resources(cfg, inst.role))
    pg = placement_group([dict(bundle) for _ in range(inst.parallel.ranks)], strategy=STRATEGY,
                         name=f"orch-{inst.name}")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise BringUpError(
            f"{inst.name}: placement group of {inst.parallel.ranks} x {bundle} ({STRATEGY}: all "
            f"on one node) not ready within {timeout:g} s: no node has those resources free (see "
            "`ray status`); lower cluster.cpus_per_rank or the tp (cp), or add nodes") from None
    return InstanceRanks(cfg=inst, pg=pg)


def rank_actor(cls: type) -> Any:
    """``cls`` as a Ray actor class of a rank: ``ACTOR_CONCURRENCY`` threads for its calls,
    plus one thread of its own for the health probe (``health.PROBE_GROUP``), so a ping
    answers while every call thread waits for the step lock.

    NOTE: ``enable_task_events=False`` (Ray's actor option): no task event per call is
    recorded and sent to the GCS each second (they feed Ray's dashboard and ``ray list
    tasks``, which orch does not use); every router call, status snapshot and rank-to-rank
    call would otherwise cost GCS CPU, per rank at cluster scale.
    """
    import ray

    return ray.remote(max_concurrency=ACTOR_CONCURRENCY, concurrency_groups={PROBE_GROUP: 1},
                      enable_task_events=False)(cls)


def create_ranks(inst: InstanceRanks, cls: type, role: type, res: ClusterSection) -> None:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    share = res.accelerators_per_rank
    accel = {"cuda": {"num_gpus": share},
             "npu": {"resources": {"NPU": share}}}.get(inst.cfg.parallel.device, {})
    remote_cls = rank_actor(cls)
    for rank in range(inst.cfg.parallel.ranks):
        strategy = PlacementGroupSchedulingStrategy(placement_group=inst.pg,
                                                    placement_group_bundle_index=rank)
        options = dict(num_cpus=res.cpus_per_rank, scheduling_strategy=strategy, **accel)
        inst.ranks.append(remote_cls.options(**options).remote(inst.cfg, rank, role))


def get_one(inst: InstanceRanks, ref: Any, step: str, timeout: float) -> Any:
    return get_ranks(inst, [ref], step, timeout)[0]


def get_ranks(inst: InstanceRanks, refs: list[Any], step: str, timeout: float) -> list[Any]:
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
                               "(worker-*.err in the rank log folder `orch up` printed), or "
                               "raise the timeout") from None
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc  # the worker's own exception
            raise BringUpError(f"{inst.cfg.name} rank {rank}: {step} failed: "
                               f"{type(cause).__name__}: {cause} (traceback in that rank's "
                               "log: worker-*.err in the rank log folder `orch up` "
                               "printed)") from None
    return out

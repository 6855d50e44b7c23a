"""Live resizing of an expert-parallel role as a whole: a new EP group beside the old one.

With ``prefill.ep`` / ``decode.ep`` every rank of the role's instances (DP ranks) is in one EP
group: the MoE all-to-alls span them all and the DP ranks step in lockstep (rank/dp_sync.py).
Adding or removing one instance would change every rank's expert share and the group itself,
so orch never half-resizes it; `orch scale CONFIG decode=N` of such a role
(:func:`resize_group`, docs/scaling.md):

1. refuses unless every instance of the role is healthy and no other scale call changes it,
   and unless the cluster's free Ray resources hold the whole new group beside the old one
   (naming each missing resource);
2. brings up the new group: instances ``{role}-{n}`` (indices past those in use) are the DP
   ranks 0..N-1 of ``dp = N``, STARTING in ``orch status``; :meth:`Cluster.add_group` gives
   each its placement group and ranks, and the group its own EP store, EP group and DP sync,
   then model load and leader start; KV pairs with the other role are made on first use;
3. switches routing: the router routes to the new instances (HEALTHY), and the old group's
   instances turn DRAINING at once, so every new request goes to the new group;
4. drains the old group: its requests finish there, or after ``router.drain_timeout_s`` move
   (placed again before their first token, migrated after it);
5. the router forgets the old instances and :meth:`Cluster.remove_group` stops their leaders
   together, kills their ranks and removes their placement groups.

A new group that fails to start is removed and the old one serves on, unchanged.

:func:`start_instances` and :func:`retire` (steps 2-3 and 4-5 for any instances) are also
how the scaler adds and removes one instance of a role without ``ep``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Callable, Protocol

from rank.config import InstanceConfig
from orchestrator.config.layout_check import check_tp_layout
from orchestrator.config.schema import OrchConfig
from orchestrator.deploy.health import Health, HealthMonitor
from orchestrator.deploy.scale_result import Scalable, ScaleError, ScaleResult
from orchestrator.deploy.assemble import leader_client
from orchestrator.router.leader import LeaderClient
from orchestrator.router.router import Router

log = logging.getLogger(__name__)


class GroupScaler(Protocol):
    """What a resize needs of the scaler (:class:`~orchestrator.deploy.scaling.Scaler`):
    its deployment, cluster, router, health monitor and leaders map; the instances it is
    starting (name -> resources), removing, and the roles it is resizing."""

    cfg: OrchConfig
    cluster: Scalable
    router: Router
    monitor: HealthMonitor
    leaders: dict[str, LeaderClient]
    pending: dict[str, dict[str, float]]
    removing: set[str]
    resizing: set[str]

    def resources(self, role: str) -> dict[str, float]:
        """Ray resources of one ``role`` instance."""

    def check_fits(self, need: dict[str, float], what: str) -> None:
        """Raises ScaleError naming what the cluster's free resources lack for ``need``."""

    def next_index(self, role: str) -> int:
        """The index of the next ``role`` instance (one past the highest in use)."""


def is_ep(cfg: OrchConfig, role: str) -> bool:
    """Whether ``role``'s instances form one EP group (``prefill.ep``, else ``decode.ep``)."""
    return bool(cfg.prefill.ep if role == "prefill" else cfg.decode.ep)


def section_name(role: str) -> str:
    """The config section that sizes ``role`` (colocated instances: ``decode``)."""
    return "prefill" if role == "prefill" else "decode"


def group_configs(cfg: OrchConfig, role: str, count: int, first: int) -> list[InstanceConfig]:
    """The instance configs of a new EP group of ``count`` DP ranks of ``role``: as
    ``cfg.instances()`` makes them with ``dp = count``, named ``{role}-{first}``..

    Raises:
        ValueError: that size is not a valid EP layout: fewer than 2 ranks in all, or an EP
            size that does not divide the model's routed experts (the load-time check,
            orchestrator/config/layout_check.py).
    """
    section = section_name(role)
    sized = cfg.model_copy(update={section: getattr(cfg, section).model_copy(
        update={"dp": count})})
    check_tp_layout(sized)
    insts = [i for i in sized.instances() if i.role == role]
    return [replace(inst, name=f"{role}-{first + n}") for n, inst in enumerate(insts)]


async def resize_group(scaler: GroupScaler, role: str, count: int) -> ScaleResult:
    """Replace the EP group of ``role`` by one of ``count`` instances (module docstring);
    returns once the new group serves and the old one is gone.

    Raises:
        ScaleError: refused (nothing changed), or the new group did not start (the old one
            serves on).
    """
    olds = [h.name for h in scaler.monitor.snapshot() if h.role == role]
    _check_can_resize(scaler, role, olds, count)
    try:
        insts = group_configs(scaler.cfg, role, count, scaler.next_index(role))
    except ValueError as exc:
        raise ScaleError(f"{role}: a group of {count} is not a valid expert-parallel layout: "
                         f"{exc}") from None
    scaler.resizing.add(role)
    try:
        started = time.monotonic()
        news = await start_instances(
            scaler, role, insts,
            lambda: scaler.cluster.add_group(insts, scaler.cfg.cluster.startup_timeout_s),
            f"the new {role} EP group ({', '.join(i.name for i in insts)}) did not start",
            "; the running group serves on unchanged")
        log.info("%s: the new EP group (%s) serves %.1f s after the scale call", role,
                 ", ".join(news), time.monotonic() - started)
        moved = await retire(scaler, olds, f"its EP group is replaced by one of {count}",
                             lambda: scaler.cluster.remove_group(olds))
    finally:
        scaler.resizing.discard(role)
    log.info("%s resized %d -> %d as a whole in %.1f s (%d request(s) moved away)", role,
             len(olds), count, time.monotonic() - started, moved)
    return ScaleResult(tuple(news), tuple(olds), moved)


def _check_can_resize(scaler: GroupScaler, role: str, olds: list[str], count: int) -> None:
    """Raises ScaleError: resized already, an instance not healthy or being changed, or the
    new group does not fit beside the old one."""
    if role in scaler.resizing:
        raise ScaleError(f"{role} is being resized already; try again once that call returns")
    busy = [h for h in scaler.monitor.snapshot() if h.role == role and (
        h.state is not Health.HEALTHY or h.name not in scaler.leaders)]
    if busy:
        raise ScaleError(f"{role} is expert-parallel and resized only as a whole, but "
                         f"{', '.join(f'{h.name} is {h.state.value}' for h in busy)}: resize "
                         "it once every instance is healthy (`orch status`)")
    per_instance = scaler.resources(role)
    need = {key: amount * count for key, amount in per_instance.items()}
    scaler.check_fits(need, f"a new {role} EP group of {count} instance(s) beside the "
                      f"running one of {len(olds)} (an EP role is resized as a whole: the new "
                      "group starts before the old one stops)")


async def start_instances(scaler: GroupScaler, role: str, insts: list[InstanceConfig],
                          start: Callable[[], list[Any]], failed: str, then: str = "") -> list[str]:
    """Bring new ``role`` instances up: STARTING in the health monitor, ``start()`` on a
    thread (blocking; the started instances, each with ``.leader``, in ``insts`` order), then
    routed to and HEALTHY; their names.

    Raises:
        ScaleError: ``"{failed}: {why}{then}"`` when ``start`` raised (it removed what it made).
    """
    names = [inst.name for inst in insts]
    for name in names:
        scaler.monitor.add_instance(name, role)
        scaler.pending[name] = scaler.resources(role)
    try:
        ranks = await asyncio.to_thread(start)
    except Exception as exc:
        for name in names:
            scaler.monitor.remove_instance(name)
        raise ScaleError(f"{failed}: {exc}{then}") from exc
    finally:
        for name in names:
            scaler.pending.pop(name, None)
    for inst, started in zip(insts, ranks):
        leader = leader_client(scaler.cfg, inst.name, role, started.leader)
        scaler.leaders[inst.name] = leader
        scaler.router.fleet.add_instance(leader)
        scaler.monitor.started(inst.name)
    return names


async def retire(scaler: GroupScaler, olds: list[str], why: str,
                 stop: Callable[[], None]) -> int:
    """Drain instances ``olds`` together (DRAINING: ``why``; their requests finish, or move
    after ``router.drain_timeout_s``), the router and monitor forget them, then ``stop()``
    (blocking, on a thread) stops them; returns how many of their requests moved away."""
    scaler.removing.update(olds)
    try:
        for name in olds:  # NOTE: from now on every new request goes to the new group
            scaler.monitor.draining(name, f"draining: {why} (`orch scale`)")
        try:
            moved = await asyncio.gather(*(scaler.router.fleet.drain_instance(
                name, scaler.cfg.router.drain_timeout_s) for name in olds))
            for name in olds:
                await scaler.router.fleet.remove_instance(name)
        except BaseException:
            for name in olds:  # NOTE: serves again rather than staying "draining" for good
                scaler.monitor.undrain(name)
            raise
        for name in olds:
            scaler.leaders.pop(name, None)
            scaler.monitor.remove_instance(name)
        await asyncio.to_thread(stop)
    finally:
        scaler.removing.difference_update(olds)
    return sum(moved)

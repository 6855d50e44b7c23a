"""Live scaling: add and remove instances while serving (docs/scaling.md).

Add: the new instance is STARTING in the health monitor (`orch status` shows it), then
placement group, rank actors, TP store, model load and leader start exactly as at bring-up
(:meth:`Cluster.add_instance`, on a worker thread), then the router polls it and places
requests on it once HEALTHY. Several adds may run at once (each gets its own name).

Remove: the instance turns DRAINING (no new request goes there), its requests finish or, after
``router.drain_timeout_s``, move away (before their first token they are placed again, after
it they migrate), then the router forgets it and its leader drains and shuts down, its ranks
are killed and its placement group removed (:meth:`Cluster.remove_instance`).

An expert-parallel role (its DP ranks form one EP group) is resized only as a whole: a new
group of the asked size beside the old one, routing switched, the old one drained
(orchestrator/deploy/ep_resize.py); adding or removing one of its instances is refused.

Refused, with what to do: the last instance of a role; an instance that is being restarted or
is still starting; one instance of an expert-parallel role; what the cluster's free resources
cannot hold (naming the missing resources).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from orchestrator.config.autoscale import AutoscaleSection
from orchestrator.config.schema import OrchConfig
from orchestrator.deploy.autoscale_plan import PlannerPredictor, planner_device
from orchestrator.deploy.autoscaler import Autoscaler, Decision, LatencyWindow, Predict, Signals
from orchestrator.deploy.ep_resize import is_ep, resize_group, retire, start_instances
from orchestrator.deploy.scale_result import (Scalable, ScaleError, ScaleResult,
                                              missing_resources)
from orchestrator.deploy.health import Health, HealthMonitor
from orchestrator.deploy.placement import rank_bundle, role_resources
from orchestrator.router.leader import LeaderClient
from orchestrator.router.router import Router

log = logging.getLogger(__name__)


class Scaler:
    """Adds and removes instances on the router's event loop.

    Args:
        cfg: the deployment (new instances are made from its role sections).
        cluster: brings instances up and down (blocking calls, run on threads).
        router: routes to the instances.
        monitor: their health (STARTING / DRAINING while scaling).
        leaders: the name -> client map the recoverer restarts through (kept up to date).
        free_resources: the cluster's free Ray resources now (default: ``ray``'s).
    """

    def __init__(self, cfg: OrchConfig, cluster: Scalable, router: Router,
                 monitor: HealthMonitor, leaders: dict[str, LeaderClient],
                 free_resources: Callable[[], dict[str, float]] | None = None) -> None:
        self.cfg, self.cluster, self.router, self.monitor = cfg, cluster, router, monitor
        self.leaders = leaders
        self._free = free_resources or _ray_free_resources
        self.pending: dict[str, dict[str, float]] = {}  # starting instance -> its resources
        self.removing: set[str] = set()  # instances being drained and removed
        self.resizing: set[str] = set()  # expert-parallel roles being resized

    def counts(self) -> dict[str, int]:
        """Role -> its instances (starting ones included, removing ones not)."""
        out = {role: 0 for role in self.router.flow.pools}
        for health in self.monitor.snapshot():
            if health.name not in self.removing:
                out[health.role] += 1
        return out

    async def scale(self, targets: dict[str, int]) -> ScaleResult:
        """Bring each role of ``targets`` (role -> instance count) to its count: adds run
        together, removals one after the other (newest instance first); an expert-parallel
        role is resized as a whole after them (:func:`~.ep_resize.resize_group`).

        Raises:
            ScaleError: a refusal (see the module docstring); nothing was changed by it.
        """
        current = self.counts()
        for role, count in targets.items():
            if role not in current:
                raise ScaleError(f"no role {role!r} here: roles {sorted(current)}")
            if count < 1:
                raise ScaleError(f"{role}: {count} instances asked; a role keeps at least 1")
        groups = {role: count for role, count in targets.items()
                  if is_ep(self.cfg, role) and count != current[role]}
        singles = {role: count for role, count in targets.items() if role not in groups}
        adds = [role for role, count in singles.items() for _ in range(count - current[role])]
        removes = [name for role, count in singles.items()
                   for name in self._newest(role, current[role] - count)]
        self._check_can_add(adds)
        added = list(await asyncio.gather(*(self.add(role) for role in adds)))
        moved = 0
        for name in removes:
            moved += await self.remove(name)
        for role, count in groups.items():
            done = await resize_group(self, role, count)
            added += done.added
            removes += done.removed
            moved += done.moved_requests
        return ScaleResult(tuple(added), tuple(removes), moved)

    async def add(self, role: str) -> str:
        """Start one more ``role`` instance; returns its name once it serves.

        Raises:
            ScaleError: refused, or its start failed (what was made is removed).
        """
        self._check_can_add([role])
        name = f"{role}-{self.next_index(role)}"
        inst = self.cfg.instance_config(role, int(name.rsplit("-", 1)[1]))
        started = time.monotonic()
        await start_instances(self, role, [inst], lambda: [self.cluster.add_instance(
            inst, self.cfg.cluster.startup_timeout_s)], f"{name} did not start")
        log.info("%s added: serving %.1f s after the scale call", name,
                 time.monotonic() - started)
        return name

    async def remove(self, name: str) -> int:
        """Drain ``name`` and stop it; returns how many of its requests had to move away.

        Raises:
            ScaleError: no such instance, the last of its role, or not removable now.
        """
        self._check_can_remove(name)
        started = time.monotonic()
        moved = await retire(self, [name], "being removed",
                             lambda: self.cluster.remove_instance(name))
        log.info("%s removed after %.1f s of draining (%d request(s) moved away)", name,
                 time.monotonic() - started, moved)
        return moved

    def _check_can_add(self, roles: list[str]) -> None:
        """Raises ScaleError: one instance of an EP role, or more than the cluster's free
        resources."""
        need: dict[str, float] = {}
        for role in roles:
            if is_ep(self.cfg, role):
                raise ScaleError(
                    f"{role} is expert-parallel: its instances form one EP group, resized "
                    f"only as a whole: `orch scale CONFIG {role}=N` (Scale) brings up a "
                    "new group of N beside it, switches routing to it and drains the old one")
            for key, amount in self.resources(role).items():
                need[key] = need.get(key, 0.0) + amount
        self.check_fits(need, f"{len(roles)} more instance(s) of {sorted(set(roles))}")

    def check_fits(self, need: dict[str, float], what: str) -> None:
        """Raises ScaleError naming each resource of ``need`` that the cluster's free
        resources (less what starting instances will take) cannot give ``what``."""
        if not need:
            return
        free = dict(self._free())
        for pending in self.pending.values():  # NOTE: starting ones may not hold theirs yet
            for key, amount in pending.items():
                free[key] = free.get(key, 0.0) - amount
        missing = missing_resources(need, free)
        if missing:
            raise ScaleError(f"the cluster cannot place {what}: {'; '.join(missing)}: add "
                             "nodes (`ray start --address`) or lower cluster.cpus_per_rank")

    def _check_can_remove(self, name: str) -> None:
        """Raises ScaleError: unknown, removing already, not healthy now, or the last one."""
        try:
            health = self.monitor.get(name)
        except KeyError:
            raise ScaleError(f"no instance {name!r}; `orch status` lists them") from None
        if name in self.removing:
            raise ScaleError(f"{name} is being removed already")
        if is_ep(self.cfg, health.role):
            raise ScaleError(f"{name} is one DP rank of the expert-parallel {health.role} "
                             "role: removing it alone would break its EP group; resize the "
                             f"role as a whole: `orch scale CONFIG {health.role}=N`")
        if health.state is not Health.HEALTHY:
            raise ScaleError(f"{name} is {health.state.value} ({health.reason}): remove it once "
                             "it is healthy, or remove another instance of its role")
        if self.counts()[health.role] <= 1:
            raise ScaleError(f"{name} is the last {health.role} instance: refusing to remove "
                             "it (a role keeps at least 1; stop `orch up` to stop serving)")
        if not self._others_serving(health.role, name):
            raise ScaleError(f"{name} is the only {health.role} instance serving now (the "
                             "others are starting or not healthy): remove it once another "
                             "one serves (`orch status`)")

    def _others_serving(self, role: str, name: str) -> int:
        """Healthy instances of ``role`` other than ``name`` that the router routes to and no
        scale call is starting or removing."""
        return sum(1 for h in self.monitor.snapshot()
                   if h.role == role and h.name != name and h.state is Health.HEALTHY
                   and h.name not in self.removing and h.name not in self.pending
                   and h.name in self.leaders)

    def newest(self, role: str) -> str:
        """The instance a scale-down of ``role`` removes (its newest healthy one).

        Raises:
            ScaleError: none can be drained now."""
        return self._newest(role, 1)[0]

    def _newest(self, role: str, count: int) -> list[str]:
        """The ``count`` newest healthy instances of ``role`` (highest index first)."""
        names = [h.name for h in self.monitor.snapshot()
                 if h.role == role and h.state is Health.HEALTHY and h.name not in self.removing]
        names.sort(key=lambda n: int(n.rsplit("-", 1)[1]), reverse=True)
        if count > 0 and len(names) < count:
            raise ScaleError(f"{role}: {count} instance(s) to remove but only {len(names)} "
                             "healthy ones can be drained now (`orch status`); try again")
        return names[:max(count, 0)]

    def next_index(self, role: str) -> int:
        used = [int(h.name.rsplit("-", 1)[1]) for h in self.monitor.snapshot()
                if h.role == role]
        return max(used, default=-1) + 1

    def resources(self, role: str) -> dict[str, float]:
        inst = self.cfg.instance_config(role, 0)
        bundle = rank_bundle(inst.parallel.device, self.cfg.cluster,
                             role_resources(self.cfg, role))
        return {key: amount * inst.parallel.ranks for key, amount in bundle.items()}


def _ray_free_resources() -> dict[str, float]:
    import ray

    return dict(ray.available_resources())


def build_autoscaler(cfg: AutoscaleSection, router: Router, scaler: Scaler,
                     window: LatencyWindow, metrics: Any = None,
                     predict: Predict | None = None) -> Autoscaler:
    """The autoscaler of a disaggregated deployment: latencies from ``window`` (fed by the
    router's metrics), waiting requests from the admission queue, steps through ``scaler``
    (an expert-parallel role resized as a whole), the planner's prediction of each candidate
    P:D (``predict``; default: :class:`~.autoscale_plan.PlannerPredictor` of the deployment
    on the measured workload); each step counted in ``metrics.autoscale_decided`` and its
    prediction set in ``metrics.autoscale_predicted`` when there are those."""
    admission = getattr(router.flow, "admission", None)
    if predict is None:
        predict = PlannerPredictor(scaler.cfg, window, planner_device(scaler.cfg),
                                   cfg.min_requests)

    def signals() -> Signals:
        ttft, tpot = window.p90(cfg.min_requests)
        return Signals(ttft, tpot, admission.waiting if admission else 0, scaler.counts())

    def record(decision: Decision) -> None:
        if metrics is not None and hasattr(metrics, "autoscale_decided"):
            metrics.autoscale_decided(decision.role, decision.delta, decision.kind)
        if decision.prediction and hasattr(metrics, "autoscale_predicted"):
            metrics.autoscale_predicted(decision.prediction.ttft_s, decision.prediction.tpot_s)
    return Autoscaler(cfg, signals, _RoleSteps(scaler), scaler.newest, record,
                      predict=predict)


class _RoleSteps:
    """The autoscaler's one-instance steps, each as a :meth:`Scaler.scale` of its role to
    one more / fewer (so an expert-parallel role is resized as a whole)."""

    def __init__(self, scaler: Scaler) -> None:
        self.scaler = scaler

    async def add(self, role: str) -> str:
        result = await self.scaler.scale({role: self.scaler.counts()[role] + 1})
        return ", ".join(result.added)

    async def remove(self, name: str) -> int:
        role = self.scaler.monitor.get(name).role
        result = await self.scaler.scale({role: self.scaler.counts()[role] - 1})
        return result.moved_requests

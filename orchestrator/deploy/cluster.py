"""Ray bring-up and tear-down of the rank actors of every instance.

Sequence (every step bounded by ``cluster.startup_timeout_s``; any failure names the
instance/rank, tears everything down and raises :class:`BringUpError`):

1. one placement group per instance (STRICT_PACK, one bundle per rank), wait until ready;
2. create the rank actors ``Rank(cfg: InstanceConfig, rank, role_cls)`` in their bundles
   (``role_cls``: the role class of ``cfg.role``,
   :data:`orchestrator.deploy.rank_actors.ROLES`), check ``node_info()`` on
   each (constructor errors surface here);
3. ``host, port = leader.open_tp_store()``; for a role with ``ep``, its first instance's
   leader also opens the role's EP store (``open_ep_store()``);
4. ``rank.init_rank(host, port, peers, ep_store)`` on every rank (``peers``: all rank handles
   of the instance, rank order; ``ep_store``: the role's EP store, None without ``ep``). With
   ``ep`` this is collective over every rank of the role (the EP group, and the leaders' DP
   sync), so every instance's ``init_rank`` is under way before any is awaited;
5. ``leader.start()``.

Progress goes to a :data:`orchestrator.deploy.progress.Report` (default: printed ``orch up: ...``
lines): one line per stage and per instance, with its node and how long it took.

:meth:`Cluster.restart_instance` repeats 1-5 for one instance whose ranks died or hang, after
killing what is left of them (automatic recovery: ``orchestrator/deploy/recovery.py``); for an
expert-parallel role, for all its instances together (one EP group spans them:
:meth:`Cluster.restart_group`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rank.config import InstanceConfig
from rank.rank import Rank
from orchestrator.config.schema import OrchConfig
from orchestrator.config.sections import ClusterSection
from orchestrator.deploy.progress import Report, Stopwatch, node_ips, nodes_text, plural, say
from orchestrator.deploy.rank_actors import (
    SHUTDOWN_TIMEOUT_S, BringUpError, InstanceRanks, create_ranks, get_one, get_ranks,
    kill_instance, load_roles, open_ep_stores, placement_group_for, start_instances,
    stop_leaders)

log = logging.getLogger(__name__)


@dataclass
class Cluster:
    """Everything :func:`bring_up` made; :meth:`teardown` undoes it exactly once.

    ``cfg``, ``rank_class`` and ``roles`` are what :meth:`restart_instance` rebuilds an
    instance from.
    An instance whose restart failed stays listed with no ranks (``pg`` None) until a later
    restart succeeds.
    """

    instances: list[InstanceRanks]
    started_ray: bool
    report: Report = say
    cfg: OrchConfig | None = None
    rank_class: type = Rank
    roles: dict[str, type] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _closed: bool = False

    def leaders(self) -> dict[str, Any]:
        """Instance name -> leader actor handle (instances that have ranks)."""
        with self._lock:
            return {inst.cfg.name: inst.leader for inst in self.instances if inst.ranks}

    def ranks_of(self, name: str) -> list[Any]:
        """The rank actor handles of instance ``name`` now, rank order (empty while a failed
        restart left it without ranks).

        Raises:
            KeyError: no instance of that name.
        """
        with self._lock:
            return list(self._find(name).ranks)

    def restart_group(self, name: str) -> list[str]:
        """The instances restarted together with ``name``: every instance of its EP group when
        the role is expert-parallel (one EP group spans the role's instances; while the role
        is resized two groups run, :meth:`add_group`), else ``name`` alone.

        Raises:
            KeyError: no instance of that name.
        """
        with self._lock:
            inst = self._find(name)
            if not inst.cfg.parallel.ep:
                return [name]
            return [i.cfg.name for i in self.instances
                    if i.cfg.role == inst.cfg.role and i.group == inst.group]

    def restart_instance(self, name: str, timeout_s: float) -> list[InstanceRanks]:
        """Replace instance ``name`` (and every instance of :meth:`restart_group`) by new rank
        actors: kill what is left of their ranks (``ray.kill`` also ends a SIGSTOPped
        process), remove their placement groups, then placement groups, actors, TP (and EP)
        stores, ``init_rank``, leader ``start()`` as at bring-up, all within ``timeout_s``.
        The new :class:`InstanceRanks` replace the old ones in ``instances``; returned in
        :meth:`restart_group` order. Blocking (call it from a thread).

        A restarted decode instance publishes new KV addresses (its reservations carry
        them); prefill ranks remake their pairs to it on first use, and a restarted prefill
        instance makes new pair generations (the KV handshake checks the layout fingerprint).

        Raises:
            KeyError: no instance of that name.
            BringUpError: a step failed or ``timeout_s`` ran out (what was made is removed;
                the instances are left without ranks), or the cluster is being torn down.
        """
        names = self.restart_group(name)
        with self._lock:
            if self._closed or self.cfg is None:
                raise BringUpError(f"{name}: not restarted: the cluster is shut down or was not "
                                   "made by bring_up")
            olds = [self._find(n) for n in names]
            for old in olds:
                self.instances[self.instances.index(old)] = InstanceRanks(old.cfg, None)
        deadline = time.monotonic() + timeout_s
        for old in olds:
            kill_instance(old)
        news = []
        try:
            for old in olds:
                news.append(placement_group_for(old.cfg, self.cfg,
                                             max(deadline - time.monotonic(), 0.01)))
                news[-1].group = old.group
            start_instances(news, self.rank_class, self.roles[olds[0].cfg.role],
                             self.cfg.cluster, deadline)
        except BaseException as exc:
            for new in news:
                kill_instance(new)
            if isinstance(exc, Exception) and not isinstance(exc, BringUpError):
                raise BringUpError(f"{name}: restart failed: {type(exc).__name__}: "
                                   f"{exc}") from exc
            raise
        self._install(news)
        return news

    def add_instance(self, inst: InstanceConfig, timeout_s: float) -> InstanceRanks:
        """Bring up one more instance (live scaling): placement group, actors, TP store,
        ``init_rank``, leader ``start()`` as at bring-up, within ``timeout_s``; listed in
        ``instances`` once it started. Blocking (call it from a thread).

        Raises:
            ValueError: an instance of that name exists, or its role is expert-parallel
                (one EP group spans the role: resize it as a whole, docs/scaling.md).
            BringUpError: a step failed or ``timeout_s`` ran out (what was made is removed).
        """
        with self._lock:
            if self._closed or self.cfg is None:
                raise BringUpError(f"{inst.name}: not added: the cluster is shut down")
            if any(i.cfg.name == inst.name for i in self.instances):
                raise ValueError(f"instance {inst.name} exists already")
        if inst.parallel.ep:
            raise ValueError(f"{inst.name}: the {inst.role} role is expert-parallel: its "
                             "instances form one EP group and are resized as a whole")
        return self._start_new([inst], timeout_s, "")[0]

    def add_group(self, insts: list[InstanceConfig], timeout_s: float) -> list[InstanceRanks]:
        """Bring up a whole new EP group of an expert-parallel role beside its running one
        (live resizing, docs/scaling.md): ``insts`` are its DP ranks (``dp_rank`` 0..dp-1,
        ``dp`` = their count, names not in use), each with its own placement group and rank
        actors; their own EP store (opened by the new DP rank 0), EP group and DP sync; TP
        stores, ``init_rank``, leader ``start()`` as at bring-up, all within ``timeout_s``.
        Listed in ``instances`` once every one started (:meth:`restart_group` keeps the
        groups apart). Blocking (call it from a thread).

        Raises:
            ValueError: a name in use, not one role, not expert-parallel, or the DP ranks
                are not 0..len(insts)-1 of dp = len(insts).
            BringUpError: a step failed or ``timeout_s`` ran out (what was made is removed).
        """
        roles = {i.role for i in insts}
        if len(roles) != 1 or not all(i.parallel.ep for i in insts) or \
                [(i.parallel.dp_rank, i.parallel.dp) for i in insts] != \
                [(n, len(insts)) for n in range(len(insts))]:
            raise ValueError("add_group: the DP ranks 0..dp-1 (dp = their count) of one "
                             f"expert-parallel role; got {[i.name for i in insts]}")
        with self._lock:
            if self._closed or self.cfg is None:
                raise BringUpError(f"{insts[0].name}..: not added: the cluster is shut down")
            if any(i.cfg.name == new.name for i in self.instances for new in insts):
                raise ValueError(f"add_group: a name of {[i.name for i in insts]} is in use")
        return self._start_new(insts, timeout_s, f"{insts[0].role}@{insts[0].name}")

    def _start_new(self, insts: list[InstanceConfig], timeout_s: float,
                   group: str) -> list[InstanceRanks]:
        """Placement groups, then steps 2-5 for new instances of one role (one EP group when
        the role is expert-parallel); listed in ``instances`` once all started.

        Raises:
            BringUpError: a step failed, ``timeout_s`` ran out or the cluster shut down
                meanwhile (what was made is removed).
        """
        names = ", ".join(i.name for i in insts)
        deadline, news = time.monotonic() + timeout_s, []
        try:
            for inst in insts:
                news.append(placement_group_for(inst, self.cfg,
                                             max(deadline - time.monotonic(), 0.01)))
                news[-1].group = group
            start_instances(news, self.rank_class, self.roles[insts[0].role],
                             self.cfg.cluster, deadline)
        except BaseException as exc:
            for new in news:
                kill_instance(new)
            if isinstance(exc, Exception) and not isinstance(exc, BringUpError):
                raise BringUpError(f"{names}: start failed: {type(exc).__name__}: "
                                   f"{exc}") from exc
            raise
        with self._lock:
            if self._closed:
                for new in news:
                    kill_instance(new)
                raise BringUpError(f"{names}: started while the cluster shut down; removed")
            self.instances.extend(news)
        for new in news:
            log.info("%s added on %s", new.cfg.name,
                     nodes_text([n for n, _ in new.nodes], node_ips()))
        return news

    def remove_instance(self, name: str, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop instance ``name`` (drained already: no request on it): leader ``drain`` +
        ``shutdown`` (each bounded by ``timeout_s``), kill its ranks, remove its placement
        group, forget it. Blocking (call it from a thread).

        Raises:
            KeyError: no instance of that name.
        """
        self.remove_group([name], timeout_s)

    def remove_group(self, names: list[str], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Stop instances ``names`` together (drained already; an old EP group once its
        replacement serves): every leader's ``drain``, then every ``shutdown`` (each bounded
        by ``timeout_s``; an EP group's DP ranks stop together, none waits for a lockstep
        round of one already gone), kill their ranks, remove their placement groups, forget
        them. Blocking (call it from a thread).

        Raises:
            KeyError: no instance of one of those names (nothing is stopped then).
        """
        with self._lock:
            insts = [self._find(name) for name in names]
            for inst in insts:
                self.instances.remove(inst)
        stop_leaders([i for i in insts if i.started and i.ranks], timeout_s)
        for inst in insts:
            kill_instance(inst)
            log.info("%s removed: ranks killed, placement group removed", inst.cfg.name)

    def _install(self, news: list[InstanceRanks]) -> None:
        """Put restarted instances in place of their empty entries (or kill them when the
        cluster shut down meanwhile).

        Raises:
            BringUpError: the cluster was torn down while they started.
        """
        with self._lock:
            if self._closed:
                for new in news:
                    kill_instance(new)
                raise BringUpError(f"{', '.join(n.cfg.name for n in news)}: restarted while the "
                                   "cluster shut down; removed")
            for new in news:
                self.instances[self.instances.index(self._find(new.cfg.name))] = new
        for new in news:
            log.info("%s restarted on %s", new.cfg.name,
                     nodes_text([node for node, _ in new.nodes], node_ips()))

    def _find(self, name: str) -> InstanceRanks:
        """Caller holds ``_lock``."""
        for inst in self.instances:
            if inst.cfg.name == name:
                return inst
        raise KeyError(f"no instance {name!r}; known: {[i.cfg.name for i in self.instances]}")

    def teardown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Started leaders ``drain`` then ``shutdown`` (each bounded by ``timeout_s``), kill
        every rank, remove the placement groups, stop Ray if we started it.

        NOTE: instances whose leader never started (an interrupted or failed start-up) are
        killed without the calls: an actor still in its constructor would answer them only
        when that ends, and they have nothing to drain.
        """
        import ray

        watch = Stopwatch()
        with self._lock:
            instances, self.instances, self._closed = self.instances, [], True
        if instances:
            self.report(f"stopping {plural(len(instances), 'instance')}")
        stop_leaders([inst for inst in instances if inst.started], timeout_s)
        for inst in instances:
            kill_instance(inst)
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
            self.report(f"stopped the ranks and the embedded Ray in {watch}")


def bring_up(cfg: OrchConfig, roles: dict[str, type] | None = None, rank_class: type = Rank,
             started_ray: bool = False, report: Report = say) -> Cluster:
    """Create and start every instance of ``cfg`` on the connected Ray cluster.

    Args:
        cfg: the deployment.
        roles: role name -> role class (default: :func:`load_roles`).
        rank_class: the plain rank actor class, made as ``rank_class(cfg, rank, role_cls)``
            (tests pass fakes).
        started_ray: whether the caller started Ray (then teardown stops it).
        report: where the progress lines go (stage, instance, node, seconds).

    Raises:
        BringUpError: a placement group, actor or init step failed or timed out.
    """
    roles = roles or load_roles()
    cluster = Cluster(instances=[], started_ray=started_ray, report=report, cfg=cfg,
                      rank_class=rank_class, roles=roles)
    timeout = cfg.cluster.startup_timeout_s
    watch = Stopwatch()
    try:
        _place(cluster, cfg, timeout)
        ips = _spawn(cluster, cfg.cluster, timeout)
        _init_and_start(cluster, timeout, watch, ips)
    except BaseException:
        cluster.teardown()
        raise
    report(f"{plural(len(cluster.instances), 'instance')} ready in {watch}")
    return cluster


def _place(cluster: Cluster, cfg: OrchConfig, timeout: float) -> None:
    """One placement group per instance, each ready (resources held) before the next."""
    instances = cfg.instances()
    ranks = sum(inst.parallel.ranks for inst in instances)
    cluster.report(f"placing {plural(len(instances), 'instance')} "
                   f"({plural(ranks, 'rank')}, one placement group per instance)")
    for inst_cfg in instances:
        cluster.instances.append(placement_group_for(inst_cfg, cfg, timeout))


def _spawn(cluster: Cluster, res: ClusterSection, timeout: float) -> dict[str, str]:
    """Start every rank process; one line per instance once its ranks answer. Returns Ray
    node id -> IP (:func:`node_ips`)."""
    ranks = sum(inst.cfg.parallel.ranks for inst in cluster.instances)
    processes = plural(ranks, "rank process", "rank processes")
    cluster.report(f"starting {processes} (each imports torch: up to a minute on a busy "
                   "machine)")
    watch = Stopwatch()
    for inst in cluster.instances:
        create_ranks(inst, cluster.rank_class, cluster.roles[inst.cfg.role], res)
    ips = {}
    for inst in cluster.instances:
        inst.nodes = get_ranks(inst, [r.node_info.remote() for r in inst.ranks],
                                "node_info", timeout)
        ips = ips or node_ips()
        processes = plural(len(inst.ranks), "rank process", "rank processes")
        where = nodes_text([node for node, _ in inst.nodes], ips)
        cluster.report(f"{inst.cfg.name}: {processes} up on {where} in {watch}")
    return ips


def _init_and_start(cluster: Cluster, timeout: float, watch: Stopwatch,
                    ips: dict[str, str]) -> None:
    """TP rendezvous and model load on every rank, then each leader's loop; one line per
    instance once it serves (``watch``: since bring-up began; ``ips``: node id -> IP)."""
    cluster.report("loading the model on every rank and joining the TP groups")
    stores = [get_one(inst, inst.leader.open_tp_store.remote(), "open_tp_store", timeout)
              for inst in cluster.instances]
    ep_stores = open_ep_stores(cluster.instances, timeout)
    inits = [[r.init_rank.remote(host, port, inst.ranks, ep_stores.get(inst.cfg.role))
              for r in inst.ranks]
             for inst, (host, port) in zip(cluster.instances, stores)]
    for inst, refs in zip(cluster.instances, inits):
        get_ranks(inst, refs, "init_rank", timeout)
        get_one(inst, inst.leader.start.remote(), "start", timeout)
        inst.started = True
        where = nodes_text([node for node, _ in inst.nodes], ips)
        cluster.report(f"{inst.cfg.name}: {plural(len(inst.ranks), 'rank')} on {where} ready "
                       f"in {watch}")



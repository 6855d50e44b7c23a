"""Tensor-parallel group of one model instance.

Rendezvous: rank 0 (the leader) opens a ``TCPStore`` on ``host:port``; the other ranks
connect to it; ``torch.distributed.init_process_group`` then builds the group on that store
with the platform's backend (hccl/nccl/gloo). NOTE: the TP group is the process's default
(WORLD) group: a rank process belongs to exactly one instance. KV-transfer pair groups are
built separately and must not use the default group.

Model code receives a :class:`TPGroup` (never a module global) and calls
:meth:`TPGroup.all_reduce` after row-parallel layers; at size 1 that is a no-op. Which
weight is split how, and the local sizes, are :mod:`engine.layout`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.network import set_gloo_interface_default


@dataclass(frozen=True)
class TPGroup:
    """One rank's view of its TP group.

    Attributes:
        rank: this rank, ``0 <= rank < size``.
        size: ranks in the group.
        group: the torch.distributed process group, None when ``size == 1``.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place and return it (no-op at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def destroy(self) -> None:
        """Tear down the process group (idempotent)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(rank: int, size: int, host: str = "127.0.0.1", port: int = 0,
                  backend: str = "gloo", timeout_s: float = 60.0,
                  store: dist.Store | None = None) -> TPGroup:
    """Join (or, on rank 0, open) the TP group of ``size`` ranks at ``host:port``.

    Size 1 returns a trivial group and touches nothing. ``store``: the leader's already open
    TCPStore (rank 0 only), used instead of opening one at ``port``. With gloo, Gloo's
    sockets use the interface that reaches ``host`` (``GLOO_SOCKET_IFNAME`` is set to it for
    this process unless set already; see :mod:`engine.network`).

    Raises:
        ValueError: bad rank/size or port 0 with size > 1 (every rank must know the port).
        RuntimeError: the default process group already exists in this process.
        torch.distributed.DistStoreError: peers did not arrive within ``timeout_s`` seconds.
        OSError: no local interface reaches ``host`` (message says to set GLOO_SOCKET_IFNAME).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a TP group of size {size}")
    if size == 1:
        return TPGroup()
    if port <= 0 and store is None:
        raise ValueError("a TP group of size > 1 needs the leader's TCPStore port (got 0): "
                         "pick a free port on the leader and pass it to every rank")
    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in this process; "
                           "one process hosts one TP rank")
    if backend == "gloo":  # NOTE: torch builds this group's Gloo device from the variable
        set_gloo_interface_default(host)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size=size, is_master=(rank == 0),
                              timeout=timeout, wait_for_workers=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return TPGroup(rank=rank, size=size, group=dist.group.WORLD)

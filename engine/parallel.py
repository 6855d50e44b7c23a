"""Process groups of one rank: its TP group, its CP group, and its role's expert-parallel group.

Rank 0 opens a ``TCPStore``, the others connect, and ``init_process_group`` builds the group
with the platform's backend (hccl/nccl/gloo). NOTE: the TP group (or, under cp > 1 with tp = 1,
the CP group) is the process's default (WORLD) group, so a rank process belongs to exactly one
instance; KV-transfer pair groups and the EP group are built from a ``PrefixStore`` and never
use it. EP spans all dp x tp ranks of a role (``ep_rank = dp_rank * tp + tp_rank``); NOTE:
every EP rank must enter every all-to-all, also with zero tokens. The CP group has a second
group over the same ranks for the layer-sharded weight broadcasts, so they overlap the token
all-gathers. Model code receives a group object, never a global; at size 1 every collective is
a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.network import gloo_devices, set_gloo_interface_default


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

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` of each rank -> ``[..., size * n]``: the ranks' tensors concatenated
        along the last dim in rank order (``x`` itself at size 1)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def destroy(self) -> None:
        """Tear down the process group (idempotent)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_tp_group(rank: int, size: int, host: str = "127.0.0.1", port: int = 0,
                  backend: str = "gloo", timeout_s: float = 60.0,
                  store: dist.Store | None = None) -> TPGroup:
    """Join (or, on rank 0, open) the TP group of ``size`` ranks at ``host:port``.

    Size 1 returns a trivial group. ``store``: the leader's open TCPStore (rank 0 only),
    instead of one at ``port``. With gloo, ``GLOO_SOCKET_IFNAME`` defaults to the interface
    that reaches ``host`` (:mod:`engine.network`).

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


@dataclass(frozen=True)
class CPGroup:
    """One rank's view of its context-parallel (CP) group.

    Attributes:
        rank: this rank, ``0 <= rank < size``. size: ranks in the group.
        group: the torch.distributed process group of the token collectives (None at size 1).
        weight_group: the group of the weight broadcasts (:meth:`broadcast`); None: ``group``.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None
    weight_group: object | None = None

    def all_gather(self, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
        """Rows of every rank, concatenated in rank order: ``x [counts[rank], ...]`` ->
        ``[sum(counts), ...]`` (``x`` itself at size 1). Row counts may differ and be zero;
        ``counts`` (rows of each rank) saves one small all-gather when every rank knows them.

        Raises:
            ValueError: ``counts[rank]`` is not ``x``'s row count.
        """
        if self.size == 1:
            return x
        if counts is None:
            counts = self._row_counts(x.shape[0])
        if counts[self.rank] != x.shape[0]:
            raise ValueError(f"CP rank {self.rank} has {x.shape[0]} rows, counts say "
                             f"{counts[self.rank]}: every rank must pass the same counts")
        width = max(counts)
        padded = x.new_zeros((width, *x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])

    def _row_counts(self, n: int) -> list[int]:
        mine = torch.tensor([n], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        return [int(p) for p in parts]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place and return it (no-op at size 1)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int, async_op: bool = False) -> dist.Work | None:
        """Broadcast ``x`` (contiguous, in place) from CP rank ``src`` over ``weight_group``
        (or ``group``); with ``async_op`` the pending :class:`torch.distributed.Work` (its
        ``wait()`` is bounded by the group's timeout), else None once done. No-op at size 1."""
        if self.size == 1:
            return None
        # NOTE: the CP group is the default (WORLD) group, so CP rank == global rank.
        return dist.broadcast(x, src=src, group=self.weight_group or self.group,
                              async_op=async_op)

    def destroy(self) -> None:
        """Tear down the groups (idempotent)."""
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def init_cp_group(rank: int, size: int, host: str = "127.0.0.1", port: int = 0,
                  backend: str = "gloo", timeout_s: float = 60.0,
                  store: dist.Store | None = None) -> CPGroup:
    """Join (or, on rank 0, open) the CP group of ``size`` ranks at ``host:port``: the default
    (WORLD) group, built exactly like :func:`init_tp_group` (same arguments, same errors), plus
    the weight-broadcast group over the same ranks. Size 1 returns a trivial group."""
    tp = init_tp_group(rank, size, host, port, backend, timeout_s, store)
    if size == 1:
        return CPGroup()
    weight_group = dist.new_group(list(range(size)), timeout=timedelta(seconds=timeout_s),
                                  backend=backend)
    return CPGroup(rank=rank, size=size, group=tp.group, weight_group=weight_group)


def ep_rank_of(dp_rank: int, tp_rank: int, tp_size: int) -> int:
    """EP rank of TP rank ``tp_rank`` of DP rank ``dp_rank`` (EP size = dp * tp)."""
    return dp_rank * tp_size + tp_rank


@dataclass(frozen=True)
class EPGroup:
    """One rank's view of its role's expert-parallel group (all dp x tp ranks).

    NOTE: every collective is one all-to-all that all ``size`` ranks enter in the same order;
    each wait is bounded by the group's timeout (``RuntimeError`` after it).

    Attributes:
        rank: this rank, ``ep_rank_of(dp_rank, tp_rank, tp)``. size: ``dp * tp``.
        group: the torch.distributed ProcessGroup, None when ``size == 1``.
    """

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_to_all_counts(self, send: torch.Tensor) -> torch.Tensor:
        """Exchange equal blocks of counts: ``send [size * n]`` int64, block ``r`` (elements
        ``r*n .. r*n+n-1``) goes to rank ``r``; returns ``[size * n]`` whose block ``r`` came
        from rank ``r`` (``send`` itself at size 1)."""
        if self.size == 1:
            return send
        recv = torch.empty_like(send)
        self._wait(self.group.alltoall_base(recv, send.contiguous(), [], [],
                                            dist.AllToAllOptions()))
        return recv

    def all_to_all_rows(self, x: torch.Tensor, send_splits: list[int],
                        recv_splits: list[int]) -> torch.Tensor:
        """Rows ``x [sum(send_splits), ...]``: the ``send_splits[r]`` rows of part ``r`` go to
        rank ``r``; returns ``[sum(recv_splits), ...]``, the rows from rank 0, 1, ... in
        order (``x`` itself at size 1). Splits may be zero (an idle rank still calls this)."""
        if self.size == 1:
            return x
        recv = x.new_empty((sum(recv_splits), *x.shape[1:]))
        self._wait(self.group.alltoall_base(recv, x.contiguous(), recv_splits, send_splits,
                                            dist.AllToAllOptions()))
        return recv

    def _wait(self, work: dist.Work) -> None:
        work.wait()  # NOTE: bounded by the group's timeout (set at construction)

    def destroy(self) -> None:
        """Release the group (idempotent; a no-op at size 1)."""
        if self.group is not None:
            self.group.shutdown()


def init_ep_group(rank: int, size: int, host: str = "127.0.0.1", port: int = 0,
                  backend: str = "gloo", timeout_s: float = 60.0,
                  store: dist.Store | None = None) -> EPGroup:
    """Join (or, on rank 0, open) the EP group of ``size`` ranks, on ``PrefixStore("ep",
    store)``; ``store`` (e.g. the role's rendezvous store) replaces a ``TCPStore`` at
    ``host:port``. Size 1 returns a trivial group. ``backend``: gloo, nccl or hccl.

    Raises:
        ValueError: bad rank/size, an unknown backend, or port 0 with size > 1 and no store.
        torch.distributed.DistStoreError / RuntimeError: peers did not arrive within
            ``timeout_s`` seconds.
        OSError: no local interface reaches ``host`` (gloo; set GLOO_SOCKET_IFNAME).
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside an EP group of size {size}")
    if size == 1:
        return EPGroup()
    if port <= 0 and store is None:
        raise ValueError("an EP group of size > 1 needs the EP rank 0's TCPStore port (got 0): "
                         "pick a free port on EP rank 0's host and pass it to every rank")
    if backend not in _GROUP_MAKERS:
        raise ValueError(f"no EP backend {backend!r}; known: {sorted(_GROUP_MAKERS)}")
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size=size, is_master=(rank == 0),
                              timeout=timeout, wait_for_workers=False)
    group = _GROUP_MAKERS[backend](dist.PrefixStore("ep", store), rank, size, timeout, host)
    return EPGroup(rank=rank, size=size, group=group)


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
                host: str) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = gloo_devices(host)  # NOTE: never Gloo's hostname guess (engine.network)
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
                host: str) -> dist.ProcessGroup:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _hccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
                host: str) -> dist.ProcessGroup:
    import torch_npu  # noqa: F401, PLC0415 (lazy: only on Ascend)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # noqa: PLC0415

    opts = ProcessGroupHCCL.Options()
    opts._timeout = timeout
    return ProcessGroupHCCL(store, rank, size, opts)


_GROUP_MAKERS = {"gloo": _gloo_group, "nccl": _nccl_group, "hccl": _hccl_group}

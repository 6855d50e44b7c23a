"""Pair backends: how to build a 2-rank process group from a store, per platform.

A registry keyed by the KV cache's device type, with lazy imports: ``cpu`` -> gloo, ``cuda``
-> NCCL, ``npu`` -> HCCL (torch_npu imported only when an npu cache is used). No global
world is ever initialized: each group is built directly from a ``PrefixStore``.

Only gloo is exercised by the tests (CPU). NCCL/HCCL entries follow the same constructor
pattern and poll ``Work.is_completed()`` for bounded waits because their ``wait`` only orders
streams; they are untested here.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from engine.network import gloo_devices
from kv_transfer.errors import TransferTimeout


@dataclass(frozen=True)
class PairBackend:
    """Builds pair groups and waits on their work with a bound.

    Attributes:
        name: ``gloo``, ``nccl`` or ``hccl``.
        make_group: ``(store, rank, timeout_s, host) -> ProcessGroup`` of size 2 (``host``:
            the rendezvous store's address, the decode rank's); blocks until both ranks
            joined or ``timeout_s`` passed (raises then).
        wait: ``(work, timeout_s) -> None``; raises :class:`TransferTimeout` when the op did
            not complete within ``timeout_s``, else the backend's own error (peer gone...).
            The caller adds the pair and the record to the message.
    """

    name: str
    make_group: Callable[[dist.Store, int, float, str], dist.ProcessGroup]
    wait: Callable[[dist.Work, float], None]


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _gloo() -> PairBackend:
    def make_group(store: dist.Store, rank: int, timeout_s: float,
                   host: str) -> dist.ProcessGroup:
        pg_cls = dist.ProcessGroupGloo
        opts = pg_cls._Options()
        opts._timeout = _td(timeout_s)
        # NOTE: never Gloo's default device (the hostname, often a loopback address): the
        # address this rank reaches the rendezvous host from, which the peer can reach too.
        opts._devices = gloo_devices(host)
        return pg_cls(store, rank, 2, opts)

    def wait(work: dist.Work, timeout_s: float) -> None:
        start = time.monotonic()
        try:
            work.wait(_td(timeout_s))
        except RuntimeError as exc:
            # NOTE: gloo raises a plain RuntimeError for a timeout and for a closed peer
            # alike; a wait that failed once its whole bound had passed is the timeout.
            if time.monotonic() - start >= timeout_s:
                raise TransferTimeout(f"no progress within {timeout_s:g} s") from exc
            raise
    return PairBackend("gloo", make_group, wait)


def _poll_wait(work: dist.Work, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransferTimeout(f"no progress within {timeout_s:g} s")
        time.sleep(0.0005)
    work.wait()  # raises the backend's error, if any


def _nccl() -> PairBackend:
    def make_group(store: dist.Store, rank: int, timeout_s: float,
                   host: str) -> dist.ProcessGroup:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _td(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return PairBackend("nccl", make_group, _poll_wait)


def _hccl() -> PairBackend:
    import torch_npu  # noqa: F401  (lazy: only on Ascend)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    def make_group(store: dist.Store, rank: int, timeout_s: float,
                   host: str) -> dist.ProcessGroup:
        opts = ProcessGroupHCCL.Options()
        opts._timeout = _td(timeout_s)
        return ProcessGroupHCCL(store, rank, 2, opts)
    return PairBackend("hccl", make_group, _poll_wait)


_REGISTRY: dict[str, Callable[[], PairBackend]] = {"cpu": _gloo, "cuda": _nccl, "npu": _hccl}


def backend_for(device: torch.device | str) -> PairBackend:
    """The pair backend for KV caches on ``device``.

    Raises:
        ValueError: no backend is registered for the device type.
    """
    kind = torch.device(device).type
    if kind not in _REGISTRY:
        raise ValueError(f"no KV pair backend for device type {kind!r}; "
                         f"known: {sorted(_REGISTRY)}")
    return _REGISTRY[kind]()

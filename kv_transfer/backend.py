"""Pair backends: how to build a 2-rank process group from a store, per platform, and how a
failed one is aborted without taking the rank process down.

A registry keyed by the KV cache's device type, with lazy imports: ``cpu`` -> gloo, ``cuda``
-> NCCL, ``npu`` -> HCCL (torch_npu imported only when an npu cache is used). No global
world is ever initialized: each group is built directly from a ``PrefixStore``.

Fault isolation (:data:`COMM_SETTINGS`, one row per backend): PyTorch's default NCCL error
handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) and its heartbeat monitor kill the whole
process when an op times out or a peer dies, so one dead decode rank would kill every prefill
rank paired with it; torch_npu's HCCL watchdog likewise (``HCCL_ASYNC_ERROR_HANDLING``). Each
group is therefore made with the row's environment set (c10d reads it in the group's
constructor) - CleanUpOnly (2): the watchdog aborts the failed communicator and the waiting
op raises - and a failed pair is aborted by :attr:`PairBackend.abort` (``ProcessGroupNCCL``
/ ``ProcessGroupHCCL`` ``abort()``), so only that pair's requests fail and the pair is remade.
Gloo needs neither: its errors raise in the waiting thread and its sockets close with the
group. Only gloo runs in the tests (CPU); NCCL/HCCL are tested with fake group classes
(tests/kv_transfer/test_backend_faults.py) and by scripts/device_check.py when a GPU is lent.
NCCL/HCCL ``wait`` only orders streams, so their bounded waits poll ``Work.is_completed()``.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from engine import envs
from engine.network import gloo_devices
from kv_transfer.errors import TransferTimeout

log = logging.getLogger(__name__)

MB = 1 << 20


@dataclass(frozen=True)
class CommSettings:
    """What one communicator backend is given so a failure stays inside its group, and the
    device memory its communicators hold (the memory plan's rows).

    Attributes:
        backend: ``gloo``, ``nccl`` or ``hccl``.
        env: environment set (overriding) before each pair group is constructed: c10d reads
            these in the constructor, so they hold for every group made after.
        pair_options: attributes set on a pair group's ``Options`` (HCCL: its own buffer,
            ``hccl_config``, sized for send/recv of :data:`kv_transfer.packs.PACK_BYTES`
            packs, :data:`~kv_transfer.packs.PACK_DEPTH` in flight).
        pair_buffer_bytes: device memory one pair group holds.
        buffer_bytes: device memory one TP / EP / CP communicator holds by default
            (``kv_transfer.comm_buffer_mb`` overrides it in the memory plan).
        abort_method: the group's method that tears its communicator down (None: dropping
            the group is enough).

    Sources: HCCL - each communicator holds 2 x ``HCCL_BUFFSIZE`` (default 200 MB: 400 MB;
    CANN "Environment Variables: HCCL_BUFFSIZE", ``HcclGetHcclBuffer``), per group
    ``hccl_config["hccl_buffer_size"]`` (torch_npu ``ProcessGroupHCCL.Options``). NCCL -
    ``NCCL_BUFFSIZE`` (4 MiB, Simple protocol) per channel and direction plus the LL/LL128
    buffers (NCCL docs "Environment Variables"): estimated 8 channels x 2 x ~5 MiB = 80 MiB
    per collective communicator, 2 channels (``NCCL_NCHANNELS_PER_NET_PEER``) x 2 x 5 MiB
    = 20 MiB per send/recv pair. Gloo: host memory only.
    """

    backend: str
    env: dict[str, str] = field(default_factory=dict)
    pair_options: dict[str, object] = field(default_factory=dict)
    pair_buffer_bytes: int = 0
    buffer_bytes: int = 0
    abort_method: str | None = None


PAIR_HCCL_BUFFER_MB = 16  # HCCL pair groups: PACK_DEPTH x PACK_BYTES = 16 MiB each way


COMM_SETTINGS: dict[str, CommSettings] = {
    "gloo": CommSettings("gloo"),
    "nccl": CommSettings("nccl", env={
        # NOTE: 2 = CleanUpOnly: abort the failed communicator, raise in the waiter; the
        # default (3, SkipCleanUp) tears the process down.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
        # NOTE: the heartbeat monitor kills the process when the watchdog is stuck in a hung
        # communicator; the pair's own bounded waits and heartbeats report a hung peer.
        "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    }, pair_buffer_bytes=20 * MB, buffer_bytes=80 * MB, abort_method="abort"),
    "hccl": CommSettings("hccl", env={
        "HCCL_ASYNC_ERROR_HANDLING": "2",  # NOTE: torch_npu mirrors c10d's modes
        "HCCL_DESYNC_DEBUG": "0",
    }, pair_options={"hccl_config": {"hccl_buffer_size": PAIR_HCCL_BUFFER_MB}},
        pair_buffer_bytes=2 * PAIR_HCCL_BUFFER_MB * MB, buffer_bytes=2 * 200 * MB,
        abort_method="abort"),
}
"""Per-backend fault settings and buffer sizes (the memory plan reads the latter)."""


@dataclass(frozen=True)
class PairBackend:
    """Builds pair groups, waits on their work with a bound, and aborts a failed group.

    Attributes:
        name: ``gloo``, ``nccl`` or ``hccl``.
        make_group: ``(store, rank, timeout_s, host) -> ProcessGroup`` of size 2 (``host``:
            the rendezvous store's address, the decode rank's); blocks until both ranks
            joined or ``timeout_s`` passed (raises then).
        wait: ``(work, timeout_s) -> None``; raises :class:`TransferTimeout` when the op did
            not complete within ``timeout_s``, else the backend's own error (peer gone...).
            The caller adds the pair and the record to the message.
        settings: the backend's :data:`COMM_SETTINGS` row.
    """

    name: str
    make_group: Callable[[dist.Store, int, float, str], dist.ProcessGroup]
    wait: Callable[[dist.Work, float], None]
    settings: CommSettings

    def abort(self, group: dist.ProcessGroup) -> None:
        """Tear ``group``'s communicator down (a failed pair; the process lives on). Never
        raises: an abort that fails is logged (the group is dropped either way)."""
        method = self.settings.abort_method
        if method is None:
            return
        try:
            getattr(group, method)()
        except Exception as exc:  # noqa: BLE001 - the pair is being dropped anyway
            log.warning("%s pair group abort failed (%s); dropping it", self.name, exc)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def apply_env(settings: CommSettings) -> None:
    """Set ``settings.env`` in this process (read by the next group's constructor)."""
    envs.set_library_env(settings.env)


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
    return PairBackend("gloo", make_group, wait, COMM_SETTINGS["gloo"])


def _poll_wait(work: dist.Work, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransferTimeout(f"no progress within {timeout_s:g} s")
        time.sleep(0.0005)
    work.wait()  # raises the backend's error, if any


def device_backend(name: str, pg_cls: type) -> PairBackend:
    """A pair backend over a device process-group class (``ProcessGroupNCCL``,
    ``ProcessGroupHCCL`` or a test's fake with the same constructor): each group is made with
    :data:`COMM_SETTINGS` ``[name]``'s environment applied, its ``pair_options`` and
    ``Options._timeout`` set."""
    settings = COMM_SETTINGS[name]

    def make_group(store: dist.Store, rank: int, timeout_s: float,
                   host: str) -> dist.ProcessGroup:
        apply_env(settings)
        opts = pg_cls.Options()
        opts._timeout = _td(timeout_s)
        for key, value in settings.pair_options.items():
            setattr(opts, key, value)
        return pg_cls(store, rank, 2, opts)
    return PairBackend(name, make_group, _poll_wait, settings)


def _nccl() -> PairBackend:
    return device_backend("nccl", dist.ProcessGroupNCCL)


def _hccl() -> PairBackend:
    import torch_npu  # noqa: F401  (lazy: only on Ascend)
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    return device_backend("hccl", ProcessGroupHCCL)


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

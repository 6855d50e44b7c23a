"""Same-node staging memory of a pair: a segment both ranks map, registered per device type.

When the prefill and the decode rank of a pair run on one node (:func:`node_id` equal at the
handshake) and ``TransferConfig.same_node`` is ``auto``, the decode rank makes a segment of
``PACK_DEPTH`` slots of ``PACK_BYTES`` and names it in its ack; the prefill rank maps it,
gathers packs into its slots, and the decode rank scatters from them (:mod:`~kv_transfer.links`):
the bytes cross no socket. A registry keyed by the cache's device type:

- ``cpu``: a file in ``/dev/shm`` (``orch-kv-<decode pid>-<uuid>``), mapped shared by both
  (``torch.from_file``), its space reserved up front (``posix_fallocate``: a full tmpfs is an
  error at set-up, never a SIGBUS later). It is unlinked as soon as both mapped it (the
  prefill rank unlinks it right after mapping, the decode rank after the group is built or
  failed), so a later crash of either leaks nothing. What can leak: a decode rank SIGKILLed
  between making the segment and the pair's group being built (a few milliseconds) leaves
  its file; every new decode connector removes the files whose pid no longer runs
  (:func:`remove_stale`).
- ``cuda``: a device tensor on the decode rank's GPU shared through CUDA IPC
  (``torch.multiprocessing.reductions``); written, never run here (no GPU in CI).
"""

from __future__ import annotations

import glob
import os
import pickle
import socket
import stat
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

SHM_DIR = "/dev/shm"
_PREFIX = "orch-kv-"


def node_id() -> str:
    """This node's identity: hostname and kernel boot id (two containers with one hostname
    on different machines differ; a segment that still cannot be opened falls back to the
    network path)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class LocalBackend:
    """Makes and maps a pair's same-node segment.

    Attributes:
        create: ``(nbytes, device) -> (uint8 tensor [nbytes], handle)``, decode side; the
            handle (bytes) travels in the ack. Raises OSError when the memory cannot be had.
        open: ``(handle, nbytes, device) -> uint8 tensor [nbytes]``, prefill side. Raises
            OSError (or RuntimeError) when the handle cannot be mapped here.
        unlink: ``(handle) -> None``; idempotent, never raises.
        sync: ``(device) -> None``: makes the copies into the segment visible to the peer
            before the doorbell (a stream sync on devices, nothing on cpu).
    """

    create: Callable[[int, torch.device], tuple[torch.Tensor, bytes]]
    open: Callable[[bytes, int, torch.device], torch.Tensor]
    unlink: Callable[[bytes], None]
    sync: Callable[[torch.device], None]


def _shm_create(nbytes: int, device: torch.device) -> tuple[torch.Tensor, bytes]:
    path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)  # NOTE: ENOSPC here, not SIGBUS on a later write
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return _shm_map(path, nbytes), path.encode()


def _shm_map(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _segment_path(handle: bytes) -> str:
    """The segment file a handle names. Raises OSError when it is not an ``orch-kv-`` file
    directly in :data:`SHM_DIR` (a handle arrives from the peer: never map or unlink any
    other path)."""
    path = handle.decode(errors="replace")
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(_PREFIX):
        raise OSError(f"not a KV segment path: {path!r}")
    return path


def _shm_open(handle: bytes, nbytes: int, device: torch.device) -> torch.Tensor:
    path = _segment_path(handle)
    if not stat.S_ISREG(os.lstat(path).st_mode):  # NOTE: a link could point anywhere
        raise OSError(f"{path} is not a regular file")
    if os.path.getsize(path) < nbytes:
        raise OSError(f"{path} holds {os.path.getsize(path)} B, expected {nbytes}")
    return _shm_map(path, nbytes)


def _shm_unlink(handle: bytes) -> None:
    try:
        os.unlink(_segment_path(handle))
    except OSError:
        pass  # NOTE: already unlinked by the peer, or not a segment path


def remove_stale() -> list[str]:
    """Remove the segment files of decode ranks that no longer run (SIGKILLed during a pair
    set-up); returns their paths."""
    gone = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{_PREFIX}*")):
        pid = os.path.basename(path)[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _shm_unlink(path.encode())
            gone.append(path)
    return gone


def _cpu() -> LocalBackend:
    return LocalBackend(_shm_create, _shm_open, _shm_unlink, lambda device: None)


def _cuda() -> LocalBackend:
    # NOTE: untested (no GPU here): CUDA IPC of one device tensor, opened on the peer's
    # device; the memory is freed when the decode rank drops it (nothing to unlink).
    from torch.multiprocessing.reductions import reduce_tensor

    def create(nbytes: int, device: torch.device) -> tuple[torch.Tensor, bytes]:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf, pickle.dumps(reduce_tensor(buf))

    def open_(handle: bytes, nbytes: int, device: torch.device) -> torch.Tensor:
        rebuild, args = pickle.loads(handle)  # NOTE: from the decode rank of our own cluster
        return rebuild(*args)

    def sync(device: torch.device) -> None:
        torch.cuda.current_stream(device).synchronize()
    return LocalBackend(create, open_, lambda handle: None, sync)


_REGISTRY: dict[str, Callable[[], LocalBackend]] = {"cpu": _cpu, "cuda": _cuda}


def local_backend(device: torch.device | str) -> LocalBackend | None:
    """The same-node backend for caches on ``device``, None when there is none (the pair
    then moves bytes over its process group)."""
    kind = torch.device(device).type
    return _REGISTRY[kind]() if kind in _REGISTRY else None

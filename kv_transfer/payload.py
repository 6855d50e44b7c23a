"""Gather a pair's layers of some token slots into one contiguous payload, and scatter back.

Shape legend: Ly layers in the transfer, T tokens, D per-token dims of the buffer (MLA: one
dim, e.g. 512 for K / 64 for V; GQA: heads-in-pair x head_dim).

The cache object is duck-typed: ``{name}_caches[layer]`` is ``[num_blocks, block_size, *dims]``
(``KVCache.k_caches`` / ``v_caches``); slot ``s`` is row ``s`` of that tensor viewed
``[num_blocks * block_size, *dims]`` (``engine.block_pool.slot_mapping``).
"""

from __future__ import annotations

import math
import threading

import torch


def flat(cache: object, name: str, layer: int, heads: slice | None) -> torch.Tensor:
    """``[num_slots, *dims]`` view of one layer's buffer, restricted to local ``heads``."""
    rows = getattr(cache, f"{name}_caches")[layer].flatten(0, 1)
    return rows if heads is None else rows[:, heads]


def payload_shape(cache: object, name: str, n_layers: int, n_tokens: int,
                  heads: slice | None) -> tuple[int, ...]:
    """Shape ``[Ly, T, *D]`` of a payload of ``name`` for this cache."""
    rest = flat(cache, name, 0, heads).shape[1:]
    return (n_layers, n_tokens, *rest)


class BufferPool:
    """Reusable payload memory, so a transfer does not page-fault fresh memory every time
    (a new 300 MB tensor costs more to first-touch than to fill).

    ``take`` hands out a byte buffer (the caller views it with :func:`as_tensor`) and the
    caller gives it back with ``give`` once the backend is done with it. At most ``keep``
    idle buffers are retained.
    """

    def __init__(self, keep: int = 4) -> None:
        self._free: list[torch.Tensor] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` on ``device``."""
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes and buf.device == device:
                    return self._free.pop(i)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel())
            del self._free[:-self._keep]


def as_tensor(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """View the first bytes of uint8 ``buf`` as a contiguous ``shape`` tensor of ``dtype``."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return buf[:nbytes].view(dtype).view(shape)


def gather(cache: object, name: str, layers: tuple[int, ...], heads: slice | None,
           src_slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ``src_slots`` of ``layers`` into ``out``, a contiguous ``[Ly, T, *D]`` tensor;
    returns ``out``.

    ``src_slots``: int64 ``[T]`` on the cache's device. One ``index_select`` per layer, written
    straight into the payload (no intermediate copy).
    """
    for i, layer in enumerate(layers):
        torch.index_select(flat(cache, name, layer, heads), 0, src_slots, out=out[i])
    return out


def scatter(cache: object, name: str, layers: tuple[int, ...], heads: slice | None,
            dst_slots: torch.Tensor, payload: torch.Tensor) -> None:
    """Write ``payload`` ``[Ly, T, *D]`` into ``dst_slots`` (int64 ``[T]``) of ``layers``.

    NOTE: ``index_copy_`` writes each slot once, in place; slots within one transfer are
    distinct (they are token positions of one request).
    """
    for i, layer in enumerate(layers):
        flat(cache, name, layer, heads).index_copy_(0, dst_slots, payload[i])


class PayloadStats:
    """Counters of one connector's data path (thread-safe).

    Attributes:
        gather_s / scatter_s: seconds spent in :func:`gather` / :func:`scatter`.
        wire_s: seconds from the doorbell to the last payload completed (send or receive).
        bytes: payload bytes moved (K + V).
        transfers: data records moved.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.gather_s = self.scatter_s = self.wire_s = 0.0
        self.bytes = self.transfers = 0

    def add(self, gather_s: float = 0.0, scatter_s: float = 0.0, wire_s: float = 0.0,
            nbytes: int = 0) -> None:
        with self._lock:
            self.gather_s += gather_s
            self.scatter_s += scatter_s
            self.wire_s += wire_s
            self.bytes += nbytes
            self.transfers += 1 if nbytes else 0

    def snapshot(self) -> dict:
        with self._lock:
            return {"gather_s": self.gather_s, "scatter_s": self.scatter_s,
                    "wire_s": self.wire_s, "bytes": self.bytes, "transfers": self.transfers}

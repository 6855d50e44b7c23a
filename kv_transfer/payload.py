"""Gather a pair's layers of some token slots into one contiguous payload, and scatter back.

Shape legend: Ly layers in the transfer, T tokens, D per-token dims of the buffer (MLA: one
dim, e.g. 512 for K / 64 for V / 128 for index_k; GQA: heads-in-pair x head_dim).

The cache object is duck-typed: ``layer_buffers(layer)`` returns the layer's buffers
``[num_blocks, block_size, *dims]``, each contiguous, in the order of ``KVLayout.buffers``
(``KVCache``: K, V[, index_k]; a layer without index_k, GLM-5.2's shared, gives K, V); a
buffer is named by its position ``buffer`` in that order.
Slot ``s`` (``engine.block_pool.slot_mapping``) is row ``s`` of a buffer viewed as token rows
(:func:`flat`).
"""

from __future__ import annotations

import math
import threading

import torch


def flat(cache: object, buffer: int, layer: int, heads: slice | None) -> torch.Tensor:
    """Slot view ``[num_blocks * block_size, *dims]`` of one layer's buffer number ``buffer``
    (row ``s`` is slot ``s``; a view, no copy), restricted to local ``heads``.

    Raises:
        RuntimeError: the buffer is not contiguous (``view`` refuses it; never a copy).
    """
    buf = cache.layer_buffers(layer)[buffer]
    rows = buf.view(buf.shape[0] * buf.shape[1], *buf.shape[2:])
    return rows if heads is None else rows[:, heads]


def cache_slots(cache: object) -> tuple[int, torch.device]:
    """Slots per layer (``num_blocks * block_size``) and device of ``cache``."""
    buf = cache.layer_buffers(0)[0]
    return buf.shape[0] * buf.shape[1], buf.device


def check_cache(cache: object, layout, heads: range | None) -> None:
    """Check that every layer of ``cache`` holds the buffers ``layout`` gives that layer, with
    this rank's dims, each one contiguous allocation.

    Args:
        layout: the rank's :class:`~kv_transfer.layout.KVLayout`.
        heads: global KV heads this rank holds (GQA), None for MLA.

    Raises:
        ValueError: buffer count or per-token dims differ (message names both), or a buffer
            is not contiguous.
    """
    for layer in range(layout.num_layers):
        bufs = cache.layer_buffers(layer)
        if not all(t.is_contiguous() for t in bufs):
            raise ValueError("the KV cache's buffers must each be contiguous [num_blocks, "
                             "block_size, *dims] (engine.kv_cache.KVCache builds them so)")
        got = [tuple(t.shape[2:]) for t in bufs]
        want = [layout.token_dims(spec, heads) for spec in layout.layer_buffers(layer)]
        if got != want:
            names = [spec.name for spec in layout.layer_buffers(layer)]
            raise ValueError(f"the KV cache holds per-token buffers {got} in layer {layer} but "
                             f"the layout names {names} with dims {want}: build the layout "
                             "from this cache's spec")


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


def gather(cache: object, buffer: int, layers: tuple[int, ...], heads: slice | None,
           src_slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Copy ``src_slots`` of ``layers`` into ``out``, a contiguous ``[Ly, T, *D]`` tensor;
    returns ``out``.

    ``src_slots``: int64 ``[T]`` on the cache's device. One ``index_select`` per layer,
    written straight into the payload (no intermediate copy).
    """
    for i, layer in enumerate(layers):
        torch.index_select(flat(cache, buffer, layer, heads), 0, src_slots, out=out[i])
    return out


def scatter(cache: object, buffer: int, layers: tuple[int, ...], heads: slice | None,
            dst_slots: torch.Tensor, payload: torch.Tensor) -> None:
    """Write ``payload`` ``[Ly, T, *D]`` into ``dst_slots`` (int64 ``[T]``, cache device) of
    ``layers``.

    NOTE: ``index_copy_`` writes each slot once, in place; slots within one transfer are
    distinct (they are token positions of one request). It runs on an int32 view of the rows
    where the row bytes allow it: about 2x the speed of bf16 / int16 elements (measured, CPU).
    """
    for i, layer in enumerate(layers):
        rows, src = _words(flat(cache, buffer, layer, heads), payload[i])
        rows.index_copy_(0, dst_slots, src)


def _words(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` viewed as int32 words along their last dim when every one's layout allows,
    else as they are (all or none: ``index_copy_`` needs one dtype).

    NOTE: a pack's buffers follow each other, so the second one of a pack starts at an odd
    element when the first one's bytes (layers x tokens x width) are not whole words."""
    for t in tensors:
        size = t.element_size()
        if (size >= 4 or t.stride(-1) != 1 or (t.shape[-1] * size) % 4
                or (t.storage_offset() * size) % 4):
            return tensors
    return tuple(t.view(torch.int32) for t in tensors)


class PayloadStats:
    """Counters of one connector's data path (thread-safe).

    Attributes:
        gather_s / scatter_s: seconds spent in :func:`gather` / :func:`scatter`.
        wire_s: seconds from the doorbell to the last payload completed (send or receive).
        bytes: payload bytes moved (every buffer: K + V[ + index_k]).
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

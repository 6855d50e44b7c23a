"""Prefill side: one sender thread per decode peer, an ordered queue of records.

Records leave in the order they were queued (the channel's order is the protocol's order:
data before ``done``). A data record gathers its K and V payloads on this thread, so the
caller's compute continues; the source slots must stay allocated until
``PrefillKVConnector.wait_idle`` returned for the request.

Failure: any error on the pair (connect, timeout, dead peer) tears the group down (it is
remade, with a new generation, for the next record) and fails every request that sent
something on that generation and had not finished; their queued records become one
``abort`` record each, sent on the fresh pair, so the decode rank learns promptly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from orch.kv_transfer import pair as pairs
from orch.kv_transfer import payload, wire
from orch.kv_transfer.backend import PairBackend
from orch.kv_transfer.config import TransferConfig
from orch.kv_transfer.errors import LayoutMismatchError
from orch.kv_transfer.layout import KVLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    """A decode rank as the prefill side addresses it."""

    instance: str
    rank: int
    host: str
    port: int


@dataclass(frozen=True)
class SendTask:
    """One record to send; ``src_slots`` int64 ``[T]`` for data records."""

    header: wire.Header
    peer: Peer
    src_slots: torch.Tensor | None = None


class SenderChannel:
    """Sender thread of one (this prefill rank, decode ``instance/rank``) pair.

    Callbacks into the owning connector (called on this thread):
        ``failed(request_id) -> str | None``: the request's error, if it already failed.
        ``fail(request_id, error)``: the request failed on this pair.
        ``finished(task)``: the task left the queue (sent, skipped or failed).
    """

    def __init__(self, cache: object, layout: KVLayout, instance: str, rank: int,
                 backend: PairBackend, config: TransferConfig, stats: payload.PayloadStats,
                 failed: Callable[[str], str | None], fail: Callable[[str, str], None],
                 finished: Callable[[SendTask], None], peer_name: str) -> None:
        self._cache, self._layout = cache, layout
        self._instance, self._rank = instance, rank
        self._backend, self._config, self._stats = backend, config, stats
        self._failed, self._fail, self._finished = failed, fail, finished
        self._queue: deque[SendTask] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pair: pairs.PairGroup | None = None
        self._pair_peer: Peer | None = None
        self._mismatch: str | None = None
        self._active: set[str] = set()   # requests with records on the current generation
        self._aborted: set[str] = set()  # requests whose abort record went out on this pair
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{peer_name}",
                                        daemon=True)
        self._thread.start()

    def put(self, task: SendTask) -> None:
        with self._cond:
            self._queue.append(task)
            self._cond.notify()

    def cancel(self, request_id: str) -> list[SendTask]:
        """Remove the queued (not yet in flight) records of ``request_id``; returns them."""
        with self._cond:
            gone = [t for t in self._queue if t.header.request_id == request_id]
            self._queue = deque(t for t in self._queue if t.header.request_id != request_id)
        return gone

    def close(self, timeout_s: float) -> None:
        """Stop the thread (after the record in flight, bounded) and drop the pair."""
        self._stop.set()
        with self._cond:
            self._cond.notify()
        self._thread.join(timeout_s)
        self._pair = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _next(self) -> SendTask | None:
        with self._cond:
            while not self._queue and not self._stop.is_set():
                self._cond.wait(self._config.poll_interval_s * 10)
            return self._queue.popleft() if self._queue and not self._stop.is_set() else None

    def _run(self) -> None:
        while (task := self._next()) is not None:
            try:
                self._handle(task)
            except Exception as exc:  # noqa: BLE001 - every pair error fails its requests
                self._teardown(task, exc)
            finally:
                self._finished(task)
        for task in self.cancel_all():
            self._finished(task)

    def cancel_all(self) -> list[SendTask]:
        with self._cond:
            gone, self._queue = list(self._queue), deque()
        return gone

    def _handle(self, task: SendTask) -> None:
        header = task.header
        rid = header.request_id
        failed = self._failed(rid)
        if failed is not None:
            # NOTE: the request already failed (here or on another pair): tell the peer once,
            # only if its pair is up; never reconnect to a peer for a lost cause.
            if self._pair is None or self._pair_peer != task.peer or rid in self._aborted:
                return
            header = self._abort_header(header, failed)
        else:
            self._ensure(task.peer)
            if self._mismatch is not None:
                self._fail(rid, self._mismatch)
                if rid in self._aborted:
                    return
                header = self._abort_header(header, self._mismatch)
        self._active.add(rid)
        if header.kind == wire.DATA:
            self._send_data(header, task.src_slots)
            return
        raw = wire.encode_header(header)
        what = f"{header.kind} record of request {rid}"
        self._pair.ring(len(raw), what)
        self._pair.send([self._bytes_tensor(raw)], self._config.header_timeout_s, what)
        self._active.discard(rid)
        if header.kind == wire.ABORT:
            self._aborted.add(rid)

    def _abort_header(self, header: wire.Header, error: str) -> wire.Header:
        if header.kind == wire.ABORT:
            return header
        return wire.Header(kind=wire.ABORT, request_id=header.request_id,
                           prefill_rank=self._rank, fingerprint=header.fingerprint, error=error)

    def _bytes_tensor(self, raw: bytes) -> torch.Tensor:
        """Header bytes as a uint8 tensor on the cache's device (NCCL/HCCL send device memory)."""
        device = getattr(self._cache, "k_caches")[0].device
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)

    def _send_data(self, header: wire.Header, src_slots: torch.Tensor) -> None:
        heads = _local_heads(self._layout, self._rank, header.head_range())
        t0 = time.perf_counter()
        bufs = [payload.gather(self._cache, spec.name, header.layers, heads, src_slots)
                for spec in self._layout.buffers]  # K then V, each [Ly, T, *D]
        t1 = time.perf_counter()
        raw = wire.encode_header(header)
        what = (f"data record of request {header.request_id} layers "
                f"{header.layers[0]}..{header.layers[-1]} tokens "
                f"[{header.token_start}, {header.token_end})")
        self._pair.ring(len(raw), what)
        self._pair.send([self._bytes_tensor(raw), *bufs], self._config.payload_timeout_s, what)
        nbytes = sum(b.numel() * b.element_size() for b in bufs)
        self._stats.add(gather_s=t1 - t0, wire_s=time.perf_counter() - t1, nbytes=nbytes)

    def _ensure(self, peer: Peer) -> None:
        if self._pair is not None and self._pair_peer == peer:
            return
        self._drop_pair()
        self._pair = pairs.connect(peer.host, peer.port, self._instance, self._rank,
                                   f"{peer.instance}/{peer.rank}", self._layout.to_dict(),
                                   self._backend, self._config)
        self._pair_peer = peer
        try:
            self._layout.check_compatible(KVLayout.from_dict(self._pair.peer_layout))
            self._mismatch = None
        except LayoutMismatchError as exc:
            self._mismatch = f"{self._pair.name}: {exc}"

    def _drop_pair(self) -> None:
        self._pair, self._pair_peer, self._mismatch = None, None, None
        self._active.clear()
        self._aborted.clear()

    def _teardown(self, task: SendTask, exc: Exception) -> None:
        name = self._pair.name if self._pair is not None else "pair"
        error = str(exc) if name in str(exc) else f"{name}: {exc}"
        log.warning("KV pair torn down: %s", error)
        for rid in self._active | {task.header.request_id}:
            self._fail(rid, error)
        self._drop_pair()


def _local_heads(layout: KVLayout, rank: int, heads: range | None) -> slice | None:
    """Global pair heads -> slice of this rank's local head axis (None for MLA)."""
    if heads is None:
        return None
    mine = layout.heads_of(rank)
    return slice(heads.start - mine.start, heads.stop - mine.start)



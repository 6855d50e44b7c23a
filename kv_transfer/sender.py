"""Prefill side: one sender thread per decode peer, an ordered queue of records.

Records leave in the order they were queued (the channel's order is the protocol's order:
data before ``done``). A data record's K and V messages are cache views where the source
slots are consecutive runs (sent in place), else gathered on this thread (the next record
is gathered while the previous one is on the wire), so the caller's compute continues; the
source slots must stay allocated, and their bytes unchanged, until
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

from kv_transfer import pair as pairs
from kv_transfer import cuts, payload, wire
from kv_transfer.backend import PairBackend
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatchError, TransferError
from kv_transfer.layout import KVLayout
from kv_transfer.peer import KVPeer

log = logging.getLogger(__name__)
_MAX_ABORTED = 4096  # remembered aborted request ids per pair
_DEPTH = 2  # data records posted to the backend and not yet landed, per pair


@dataclass(frozen=True)
class SendTask:
    """One record to send; ``src_slots`` int64 ``[T]`` for data records."""

    header: wire.Header
    peer: KVPeer
    src_slots: torch.Tensor | None = None


@dataclass
class _Gathered:
    """The record's payload messages, K layers then V layers, each ``[T, *D]``: views of the
    cache (contiguous source slots) or of pooled byte buffers ``raws`` (gathered)."""

    bufs: list[torch.Tensor]
    raws: list[torch.Tensor]


@dataclass
class _Flight:
    """A data record posted to the backend, not yet known to have left."""

    task: SendTask
    pair: pairs.PairGroup
    works: list
    what: str
    posted: float
    nbytes: int
    payload: _Gathered  # NOTE: keeps the payloads alive until the sends complete


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
        self._device = cache.k_caches[0].device
        self._pool = payload.BufferPool(keep=4)  # K+V of the record in flight + the next
        self._queue: deque[SendTask] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pair: pairs.PairGroup | None = None
        self._pair_peer: KVPeer | None = None
        self._mismatch: str | None = None
        self._active: set[str] = set()   # requests with records on the current generation
        # requests whose abort record went out on this pair (insertion-ordered, bounded)
        self._aborted: dict[str, None] = {}
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

    def _next(self, block: bool) -> SendTask | None:
        """Next queued task; None when stopping, or (``block=False``) when the queue is empty."""
        with self._cond:
            while block and not self._queue and not self._stop.is_set():
                self._cond.wait(self._config.poll_interval_s * 10)
            return self._queue.popleft() if self._queue and not self._stop.is_set() else None

    def _run(self) -> None:
        # NOTE: up to _DEPTH data records are on the wire while the next one is gathered:
        # the gather (memory copy on this thread) overlaps the wire (the backend's threads),
        # and the receiver finds the next record's doorbell and sends already posted when it
        # finishes one (no idle wire between records).
        flights: deque[_Flight] = deque()
        while True:
            task = self._next(block=not flights)
            if task is None and not flights:
                break
            if task is None:
                self._land(flights.popleft())
                continue
            ahead = self._gather(task) if flights else None
            while len(flights) >= _DEPTH:
                self._land(flights.popleft())
            flight = None
            try:
                flight = self._handle(task, ahead)
            except Exception as exc:  # noqa: BLE001 - every pair error fails its requests
                self._teardown(task, exc)
                ahead = None  # NOTE: the backend may still hold it; let it be freed
            if flight is None:
                self._give(ahead)
                self._finished(task)
            else:
                flights.append(flight)
        for task in self.cancel_all():
            self._finished(task)

    def cancel_all(self) -> list[SendTask]:
        with self._cond:
            gone, self._queue = list(self._queue), deque()
        return gone

    def _land(self, flight: _Flight) -> None:
        """Wait (bounded) for an in-flight data record; a failure tears the pair down."""
        if flight.pair is not self._pair:
            # NOTE: its pair generation was torn down (its request failed then); the backend
            # may still hold the payload: not given back to the pool.
            self._finished(flight.task)
            return
        try:
            self._pair.wait_sent(flight.works, self._config.payload_timeout_s, flight.what)
            self._stats.add(wire_s=time.perf_counter() - flight.posted, nbytes=flight.nbytes)
        except Exception as exc:  # noqa: BLE001
            self._teardown(flight.task, exc)
        else:
            self._give(flight.payload)
        finally:
            self._finished(flight.task)

    def _give(self, gathered: _Gathered | None) -> None:
        for raw in gathered.raws if gathered is not None else ():
            self._pool.give(raw)

    def _handle(self, task: SendTask, ahead: _Gathered | None) -> _Flight | None:
        """Send ``task``'s record: data records are posted and returned in flight."""
        header = task.header
        rid = header.request_id
        failed = self._failed(rid)
        if failed is not None:
            # NOTE: the request already failed (here or on another pair): tell the peer once,
            # only if its pair is up; never reconnect to a peer for a lost cause.
            if self._pair is None or self._pair_peer != task.peer or rid in self._aborted:
                return None
            header = self._abort_header(header, failed)
        else:
            self._ensure(task.peer)
            if self._mismatch is not None:
                self._fail(rid, self._mismatch)
                if rid in self._aborted:
                    return None
                header = self._abort_header(header, self._mismatch)
        self._active.add(rid)
        if header.kind == wire.DATA:
            return self._post_data(task, ahead if ahead is not None else self._gather(task))
        what = f"{header.kind} record of request {rid}"
        self._pair.post_doorbell(wire.encode_header(header), what)  # done/abort: doorbell only
        self._active.discard(rid)
        if header.kind == wire.ABORT:
            self._aborted[rid] = None
            if len(self._aborted) > _MAX_ABORTED:
                del self._aborted[next(iter(self._aborted))]
        return None

    def _abort_header(self, header: wire.Header, error: str) -> wire.Header:
        if header.kind == wire.ABORT:
            return header
        return wire.Header(kind=wire.ABORT, request_id=header.request_id,
                           prefill_rank=self._rank, fingerprint=header.fingerprint, error=error)

    def _gather(self, task: SendTask) -> _Gathered | None:
        """The wire messages of a data task (None for other records); see
        :func:`cuts.source_messages` (views of the cache where the slots allow, else one
        gather per buffer into pooled memory)."""
        header = task.header
        if header.kind != wire.DATA:
            return None
        heads = _local_heads(self._layout, self._rank, header.head_range())
        t0 = time.perf_counter()
        bufs, raws = cuts.source_messages(self._cache, self._layout, header, heads,
                                          task.src_slots, self._pool, self._device)
        if raws:
            self._stats.add(gather_s=time.perf_counter() - t0)
        return _Gathered(bufs, raws)

    def _post_data(self, task: SendTask, got: _Gathered) -> _Flight:
        header = task.header
        raw = wire.encode_header(header)
        what = (f"data record of request {header.request_id} layers "
                f"{header.layers[0]}..{header.layers[-1]} tokens "
                f"[{header.token_start}, {header.token_end})")
        self._pair.post_doorbell(raw, what)
        works = self._pair.post(got.bufs, what)
        nbytes = sum(b.numel() * b.element_size() for b in got.bufs)
        return _Flight(task, self._pair, works, what, time.perf_counter(), nbytes, got)

    def _ensure(self, peer: KVPeer) -> None:
        if self._pair is not None and self._pair_peer == peer:
            return
        if self._pair is not None:  # the decode rank moved (restarted): its requests are lost
            old = self._pair_peer
            for rid in self._active:
                self._fail(rid, f"{self._pair.name}: decode {peer.instance}/{peer.rank} moved "
                                f"from {old.host}:{old.port} to {peer.host}:{peer.port} "
                                "(restarted); records sent before were lost")
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
        if isinstance(exc, TransferError) and exc.pair is not None:
            error = str(exc)  # the message names its pair already
        else:
            error = f"{self._pair.name if self._pair is not None else 'KV pair'}: {exc}"
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



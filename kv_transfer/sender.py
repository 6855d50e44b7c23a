"""Prefill side: one sender thread per decode peer, an ordered queue of records.

Records leave in the order they were queued (the channel's order is the protocol's order:
data before ``done``); data records are posted by :mod:`~kv_transfer.send_record`, up to
``_DEPTH`` in flight, so the caller's compute continues. Any error on the pair (connect,
timeout, dead peer, failed heartbeat) tears the pair generation down and fails every request
that had records on it; their queued records become one ``abort`` per request, sent only on a
pair that is up (none is made for a failed request, nor for an ``abort``).

Dead peers (docs/kv_transfer.md "Dead peers"): a failed connect marks the decode address down
for a doubling back-off (:func:`~kv_transfer.send_rules.mark_down`), during which its records
fail their request without a connect; a new address of the same rank is tried at once; a
record whose connect is under way is cancellable (:meth:`SenderChannel.cancel`), so an abort
never waits for a connect. While a pair is up the thread posts a heartbeat every
``heartbeat_s``.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

from kv_transfer import pair as pairs
from kv_transfer import links, local, payload, wire
from kv_transfer.backend import PairBackend
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatchError, TransferError
from kv_transfer.layer_ready import CopyStream
from kv_transfer.layout import KVLayout
from kv_transfer.peer import KVPeer
from kv_transfer.send_record import InFlight, post_data, wait_sent
from kv_transfer.send_rules import PeerDown, failure_text, header_to_send, mark_down

log = logging.getLogger(__name__)
_MAX_ABORTED = 4096  # remembered aborted request ids per pair
_DEPTH = 2  # data records posted to the backend and not yet known to have left, per pair


class _Cancelled(Exception):
    """The record's connect was under way when :meth:`SenderChannel.cancel` took it."""


@dataclass(frozen=True)
class SendTask:
    """One queued record: ``header`` (a data record's ``chunk`` holds its source slots), to
    the decode rank ``peer``; ``written``: on a device, the event after which its layers'
    KV may be read (:func:`~kv_transfer.layer_ready.mark_written`), else None."""

    header: wire.Header
    peer: KVPeer
    written: object | None = None


class SendOwner(abc.ABC):
    """What a sender channel asks of the connector that owns it: per-request state.

    Called on the channel's thread (implementations are thread-safe), for the tasks the
    owner :meth:`~SenderChannel.put`; the owner keeps the state, the channel only reports.
    """

    @abc.abstractmethod
    def failure(self, request_id: str) -> str | None:
        """The request's error if it already failed (on any pair), else None."""

    @abc.abstractmethod
    def fail(self, request_id: str, error: str) -> None:
        """The request failed on this channel's pair (``error`` names the pair)."""

    @abc.abstractmethod
    def finished(self, header: wire.Header) -> None:
        """The record ``header`` left the channel (sent, skipped, failed or cancelled); once
        per task put."""


class SenderChannel:
    """Sender thread of one (this prefill rank, decode ``instance/rank``) pair.

    The thread pumps the queue (:meth:`_run`): :func:`header_to_send` decides what each
    record becomes; data records are posted and waited for up to ``_DEPTH`` at a time;
    every pair error tears the pair generation down (:meth:`_teardown`). ``owner`` keeps the
    requests' state (:class:`SendOwner`).
    """

    def __init__(self, cache: object, layout: KVLayout, instance: str, rank: int,
                 backend: PairBackend, config: TransferConfig, stats: payload.PayloadStats,
                 owner: SendOwner, peer_name: str) -> None:
        self._cache, self._layout = cache, layout
        self._instance, self._rank = instance, rank
        self._backend, self._config, self._stats = backend, config, stats
        self._owner = owner
        self._device = payload.cache_slots(cache)[1]
        self._copies = CopyStream(self._device)
        self._link: links.NetSender | links.LocalSender | None = None  # of the current pair
        self._queue: deque[SendTask] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pair: pairs.PairGroup | None = None
        self._pair_peer: KVPeer | None = None
        self._down: PeerDown | None = None
        self._connecting: SendTask | None = None  # guarded by _cond; cancel() may take it
        self._next_beat = 0.0
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
        """Remove the records of ``request_id`` that are queued or waiting for a connect (not
        yet on the wire); returns them (the caller reports them finished, the thread never
        will)."""
        with self._cond:
            gone = [t for t in self._queue if t.header.request_id == request_id]
            self._queue = deque(t for t in self._queue if t.header.request_id != request_id)
            if self._connecting is not None and \
                    self._connecting.header.request_id == request_id:
                gone.append(self._connecting)
                self._connecting = None
        return gone

    def close(self, timeout_s: float) -> None:
        """Stop the thread (after the record in flight, bounded) and drop the pair."""
        self._stop.set()
        with self._cond:
            self._cond.notify()
        self._thread.join(timeout_s)
        self._pair = None

    def _next(self, block: bool) -> SendTask | None:
        """Next queued task (with the data records that extend it, :meth:`_extend`); None
        when stopping, or (``block=False``) when the queue is empty. Posts the pair's
        heartbeats meanwhile."""
        wait_s = min(self._config.poll_interval_s * 10, self._config.heartbeat_s)
        while True:
            self._beat()
            with self._cond:
                if not block or self._queue or self._stop.is_set():
                    if not self._queue or self._stop.is_set():
                        return None
                    task, absorbed = self._extend(self._queue.popleft())
                    break
                self._cond.wait(wait_s)
        for t in absorbed:  # NOTE: ``task`` carries their bytes and stays pending for them
            self._owner.finished(t.header)
        return task

    def _extend(self, task: SendTask) -> tuple[SendTask, list[SendTask]]:
        """Caller holds ``_cond``. ``task`` with the queued data records of the same request,
        token range and heads whose layers follow its own, taken out of the queue: one record
        instead of one per layer when the wire is behind (layer by layer), so a backlog goes
        out in records as large as whole chunks. Scanning a request stops at its first
        ``done`` or ``abort`` record (order within a request is kept). Returns the record to
        send and the tasks it absorbed; on a device it waits for the newest absorbed
        layer's event (one compute stream: the earlier layers were written before)."""
        head = task.header
        if head.kind != wire.DATA or not self._queue:
            return task, []
        c, layers, written = head.chunk, list(head.chunk.layers), task.written
        absorbed, keep, closed = [], deque(), False
        for t in self._queue:
            h = t.header
            if closed or h.request_id != head.request_id:
                keep.append(t)
                continue
            closed = h.kind != wire.DATA
            d = h.chunk
            if not closed and t.peer == task.peer and (d.token_start, d.token_end, d.heads) \
                    == (c.token_start, c.token_end, c.heads) and d.layers[0] == layers[-1] + 1:
                layers.extend(d.layers)
                written = t.written if t.written is not None else written
                absorbed.append(t)
            else:
                keep.append(t)
        if not absorbed:
            return task, []
        self._queue = keep
        chunk = replace(c, layers=tuple(layers))
        return SendTask(replace(head, chunk=chunk), task.peer, written), absorbed

    def _beat(self) -> None:
        """Post a heartbeat on the pair if one is due; a failed one tears the pair down."""
        now = time.monotonic()
        if self._pair is None or now < self._next_beat:
            return
        self._next_beat = now + self._config.heartbeat_s
        try:
            self._pair.beat()
        except Exception as exc:  # noqa: BLE001 - the decode rank is gone: drop the pair
            self._teardown(exc)

    def _run(self) -> None:
        # NOTE: up to _DEPTH data records are on the wire while the next one is posted: the
        # receiver finds the next record's doorbell and sends already posted when it finishes
        # one (no idle wire between records); inside a record the gather of a pack
        # overlaps the wire of the ones before it (links.py).
        in_flight: deque[InFlight] = deque()
        while (task := self._next(block=not in_flight)) is not None or in_flight:
            if task is None:
                self._wait_sent(in_flight.popleft())
                continue
            while len(in_flight) >= _DEPTH:
                self._wait_sent(in_flight.popleft())
            try:
                sent = self._send(task)
            except _Cancelled:  # NOTE: cancel() reported it finished; nothing was posted
                continue
            except Exception as exc:  # noqa: BLE001 - every pair error fails its requests
                self._teardown(exc, task.header.request_id)
                self._owner.finished(task.header)
                continue
            if sent is None:
                self._owner.finished(task.header)
            else:
                in_flight.append(sent)
        with self._cond:
            left, self._queue = list(self._queue), deque()
        for task in left:
            self._owner.finished(task.header)
        self._drain()

    def _drain(self) -> None:
        """Stopping: wait (bounded) until the pair's link is idle (same node: every pack
        acked, :meth:`links.LocalSender.drain`) before the pair is dropped; a failure only
        tears the pair down (the requests on it were reported finished already)."""
        pair, link = self._pair, self._link  # NOTE: close() drops the pair after its join
        if pair is None or link is None:
            return
        try:
            link.drain(f"close of {pair.name}")
        except Exception as exc:  # noqa: BLE001 - closing: the pair is dropped either way
            self._teardown(exc)

    def _send(self, task: SendTask) -> InFlight | None:
        """Put ``task``'s record (or the abort in its place) on the wire; a data record is
        returned in flight. Raises the pair's errors."""
        rid = task.header.request_id
        failure = self._owner.failure(rid)
        if failure is None and task.header.kind != wire.ABORT:
            self._connect(task)
            if self._mismatch is not None:
                self._owner.fail(rid, self._mismatch)
            failure = self._owner.failure(rid)  # NOTE: set when the peer is down
        header = header_to_send(task.header, failure, self._mismatch,
                                self._pair is not None and self._pair_peer == task.peer,
                                rid in self._aborted)
        if header is None:
            return None
        self._active.add(rid)
        if header.kind == wire.DATA:
            with self._copies.after(task.written):
                return post_data(self._cache, self._layout, self._rank, self._pair,
                                 self._link, header, self._stats)
        what = f"{header.kind} record of request {rid}"
        self._pair.post_doorbell(wire.encode_header(header), what)  # done/abort: doorbell only
        self._active.discard(rid)
        if header.kind == wire.ABORT:
            self._aborted[rid] = None
            if len(self._aborted) > _MAX_ABORTED:
                del self._aborted[next(iter(self._aborted))]
        return None

    def _wait_sent(self, sent: InFlight) -> None:
        """Wait (bounded) until an in-flight data record left; a failure tears the pair down."""
        try:
            if sent.pair is not self._pair:
                # NOTE: its pair generation was torn down (its request failed then); the
                # backend may still hold the payload: not given back to the pool.
                return
            wait_sent(sent, self._config.payload_timeout_s, self._stats)
        except Exception as exc:  # noqa: BLE001
            self._teardown(exc, sent.header.request_id)
        finally:
            self._owner.finished(sent.header)

    def _make_link(self) -> links.NetSender | links.LocalSender:
        """The pack transport of the pair just made: its same-node segment if it has one."""
        timeout_s = self._config.payload_timeout_s
        if self._pair.local is not None:
            return links.LocalSender(self._pair, self._pair.local,
                                     local.local_backend(self._device), self._device, timeout_s)
        return links.NetSender(self._pair, self._device, timeout_s)

    def _connect(self, task: SendTask) -> None:
        """Make the pair to ``task.peer`` current: kept if up, else a new generation; while
        that peer's address is down (backoff), fail ``task``'s request instead.

        Raises:
            TransferError: the connect failed (the address is marked down).
            _Cancelled: :meth:`cancel` took ``task`` while it connected.
        """
        peer = task.peer
        if self._pair is not None and self._pair_peer == peer:
            return
        down = self._down
        if down is not None and down.peer == peer and time.monotonic() < down.retry_at:
            self._owner.fail(task.header.request_id, f"{down.error} (next try in "
                             f"{down.retry_at - time.monotonic():.1f} s)")
            return
        if self._pair is not None:  # the decode rank moved (restarted): its requests are lost
            old = self._pair_peer
            for rid in self._active:
                self._owner.fail(rid, f"{self._pair.name}: decode {peer.instance}/{peer.rank} "
                                      f"moved from {old.host}:{old.port} to {peer.host}:"
                                      f"{peer.port} (restarted); records sent before were lost")
        self._drop_pair()
        with self._cond:
            self._connecting = task
        try:
            self._pair = pairs.connect(peer.host, peer.port, self._instance, self._rank,
                                       f"{peer.instance}/{peer.rank}", self._layout.to_dict(),
                                       self._backend, self._config, self._device)
        except TransferError as exc:
            self._down = mark_down(self._down, peer, str(exc), self._config, time.monotonic())
            log.debug("KV peer down: %s", exc)  # NOTE: the teardown warns
            if not self._take_connecting(task):
                raise _Cancelled() from exc
            raise
        self._pair_peer, self._down = peer, None
        self._link = self._make_link()
        self._next_beat = time.monotonic() + self._config.heartbeat_s
        try:
            self._layout.check_compatible(KVLayout.from_dict(self._pair.peer_layout))
            self._mismatch = None
        except LayoutMismatchError as exc:
            self._mismatch = f"{self._pair.name}: {exc}"
        if not self._take_connecting(task):
            raise _Cancelled()

    def _take_connecting(self, task: SendTask) -> bool:
        """End ``task``'s connect; False when :meth:`cancel` took it meanwhile."""
        with self._cond:
            mine = self._connecting is task
            self._connecting = None
        return mine

    def _drop_pair(self) -> None:
        self._pair, self._pair_peer, self._mismatch, self._link = None, None, None, None
        self._active.clear()
        self._aborted.clear()

    def _teardown(self, exc: Exception, request_id: str | None = None) -> None:
        """Fail every request with records on the current generation (and ``request_id``),
        and drop it."""
        error = failure_text(exc, self._pair.name if self._pair is not None else None)
        log.warning("KV pair torn down: %s", error)
        rids = self._active | ({request_id} if request_id is not None else set())
        for rid in rids:
            self._owner.fail(rid, error)
        if self._pair is not None:
            self._pair.abort()
        self._drop_pair()


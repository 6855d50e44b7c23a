"""Prefill side: one sender thread per decode peer, an ordered queue of records.

Records leave in the order they were queued (the channel's order is the protocol's order:
data before ``done``). A data record's buffers with long slot runs (all of them when both
slot lists are one run) go as cache views per run (no copy; network pairs); the others are
gathered pack by pack on this thread (:mod:`~kv_transfer.packs`), pack ``i + 1`` while pack
``i`` is on the wire, into pooled staging memory or, on a same-node pair, into the pair's
shared segment (:mod:`~kv_transfer.links`), so the caller's compute continues; the source slots must stay
allocated, and their bytes unchanged, until ``PrefillKVConnector.wait_idle`` returned for
the request.

Failure: any error on the pair (connect, timeout, dead peer) tears the group down (it is
remade, with a new generation, for the next record of a live request) and fails every
request that sent something on that generation and had not finished; their queued records
become one ``abort`` record per request, sent if a fresh pair to that decode rank is up (one
is never made for a failed request, nor for an ``abort`` record), so the decode rank learns
promptly.

Dead peers: a failed connect marks the decode address down; records to it fail their
request at once (no connect) until a backoff passed (``retry_backoff_s``, doubling per
failure up to ``connect_timeout_s``); a new address of the same decode rank (it restarted)
is tried at once. A record whose connect is under way is cancellable (:meth:`cancel`), so an
abort never waits for a connect. While a pair is up the thread posts a heartbeat every
``heartbeat_s`` (the decode side's liveness check); a failed heartbeat tears the pair down.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, replace

import torch

from kv_transfer import pair as pairs
from kv_transfer import links, local, packs, payload, wire
from kv_transfer.backend import PairBackend
from kv_transfer.config import TransferConfig
from kv_transfer.errors import LayoutMismatchError, TransferError
from kv_transfer.layout import KVLayout
from kv_transfer.peer import KVPeer
from kv_transfer.send_rules import failure_text, header_to_send

log = logging.getLogger(__name__)
_MAX_ABORTED = 4096  # remembered aborted request ids per pair
_DEPTH = 2  # data records posted to the backend and not yet known to have left, per pair


class _Cancelled(Exception):
    """The record's connect was under way when :meth:`SenderChannel.cancel` took it."""


@dataclass(frozen=True)
class _Down:
    """The last failed connect of a channel: to ``peer``; records to it fail with ``error``
    until ``retry_at`` (monotonic seconds); ``backoff_s`` is the wait that led there."""

    peer: KVPeer
    error: str
    retry_at: float
    backoff_s: float


@dataclass(frozen=True)
class SendTask:
    """One record to send; ``src_slots`` int64 ``[T]`` for data records."""

    header: wire.Header
    peer: KVPeer
    src_slots: torch.Tensor | None = None


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
    def finished(self, task: SendTask) -> None:
        """``task`` left the channel (sent, skipped, failed or cancelled); once per task put."""


@dataclass
class _InFlight:
    """A data record posted to the backend, not yet known to have left: ``works`` and the
    cache ``views`` they send, and its packs up to ``upto`` of ``link`` (None: no packs)."""

    task: SendTask
    pair: pairs.PairGroup
    works: list
    views: list[torch.Tensor]  # NOTE: keeps the views alive until the sends complete
    link: links.NetSender | links.LocalSender | None
    upto: int
    what: str
    posted: float
    nbytes: int


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
        self._link: links.NetSender | links.LocalSender | None = None  # of the current pair
        self._queue: deque[SendTask] = deque()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pair: pairs.PairGroup | None = None
        self._pair_peer: KVPeer | None = None
        self._down: _Down | None = None
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
        """Next queued task; None when stopping, or (``block=False``) when the queue is empty.
        Posts the pair's heartbeats meanwhile."""
        wait_s = min(self._config.poll_interval_s * 10, self._config.heartbeat_s)
        while True:
            self._beat()
            with self._cond:
                if not block or self._queue or self._stop.is_set():
                    return self._queue.popleft() if self._queue and not self._stop.is_set() \
                        else None
                self._cond.wait(wait_s)

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
        in_flight: deque[_InFlight] = deque()
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
                self._teardown(exc, task)
                self._owner.finished(task)
                continue
            if sent is None:
                self._owner.finished(task)
            else:
                in_flight.append(sent)
        with self._cond:
            left, self._queue = list(self._queue), deque()
        for task in left:
            self._owner.finished(task)

    def _send(self, task: SendTask) -> _InFlight | None:
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
            return self._post_data(task)
        what = f"{header.kind} record of request {rid}"
        self._pair.post_doorbell(wire.encode_header(header), what)  # done/abort: doorbell only
        self._active.discard(rid)
        if header.kind == wire.ABORT:
            self._aborted[rid] = None
            if len(self._aborted) > _MAX_ABORTED:
                del self._aborted[next(iter(self._aborted))]
        return None

    def _wait_sent(self, sent: _InFlight) -> None:
        """Wait (bounded) until an in-flight data record left; a failure tears the pair down."""
        if sent.pair is not self._pair:
            # NOTE: its pair generation was torn down (its request failed then); the backend
            # may still hold the payload: not given back to the pool.
            self._owner.finished(sent.task)
            return
        try:
            self._pair.wait_sent(sent.works, self._config.payload_timeout_s, sent.what)
            if sent.link is not None:
                sent.link.wait(sent.upto, sent.what)
            self._stats.add(wire_s=time.perf_counter() - sent.posted, nbytes=sent.nbytes)
        except Exception as exc:  # noqa: BLE001
            self._teardown(exc, sent.task)
        finally:
            self._owner.finished(sent.task)

    def _post_data(self, task: SendTask) -> _InFlight:
        """Ring the record's doorbell and post its payload: the view buffers' cache views,
        then the packs, each gathered while the ones before it are on the wire."""
        heads = _local_heads(self._layout, self._rank, task.header.head_range())
        header, views = self._plan_views(task, heads)
        what = (f"data record of request {header.request_id} layers "
                f"{header.layers[0]}..{header.layers[-1]} tokens "
                f"[{header.token_start}, {header.token_end})")
        self._pair.post_doorbell(wire.encode_header(header), what)
        posted = time.perf_counter()
        works = self._pair.post(views, what)
        src = payload.rows_of(self._cache, task.src_slots.to(self._device))
        seq, gather_s = 0, 0.0
        frames = packs.packs(self._layout, header)
        for pack in frames:
            buf = self._link.take(pack.nbytes, what)
            t0 = time.perf_counter()
            packs.gather(self._cache, self._layout, header, heads, src, pack, buf)
            gather_s += time.perf_counter() - t0
            seq = self._link.post(buf, pack.nbytes, what)
        if frames:
            self._stats.add(gather_s=gather_s)
        nbytes = sum(v.numel() * v.element_size() for v in views) + \
            sum(p.nbytes for p in frames)
        return _InFlight(task, self._pair, works, views, self._link if frames else None, seq,
                         what, posted, nbytes)

    def _plan_views(self, task: SendTask,
                    heads: slice | None) -> tuple[wire.Header, list[torch.Tensor]]:
        """The record's header (its ``views`` and ``cuts``) and the cache views to send:
        none on a same-node pair, nor when a view would not be contiguous (GQA)."""
        header = task.header
        if not isinstance(self._link, links.NetSender):
            return header, []
        peer = KVLayout.from_dict(self._pair.peer_layout)
        if heads is None:
            planned = packs.plan_block_views(self._cache, self._layout, peer, header,
                                             task.src_slots.cpu())
            if planned is not None:
                return planned
        found = packs.cut_runs(payload.rows_of(self._cache, task.src_slots.cpu()),
                               peer.slot_rows(header.dst_slots.cpu()))
        header = replace(header, views=packs.view_buffers(
                             self._layout, header, len(found) * len(header.layers),
                             len(found) == 1),
                         cuts=tuple(a for a, _, _, _ in found))
        views = packs.cut_views(self._cache, self._layout, header, heads,
                                [s for _, s, _, _ in found])
        if not all(v.is_contiguous() for v in views):
            return replace(header, views=(), cuts=()), []
        if not header.views:
            header = replace(header, cuts=())
        return header, views

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
            self._mark_down(peer, exc)
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

    def _mark_down(self, peer: KVPeer, exc: TransferError) -> None:
        """``peer``'s address failed a connect: back off (doubling) before the next try."""
        last = self._down
        backoff = self._config.retry_backoff_s if last is None or last.peer != peer else \
            min(2 * last.backoff_s, self._config.connect_timeout_s)
        self._down = _Down(peer, str(exc), time.monotonic() + backoff, backoff)
        log.debug("KV peer down, next try in %.1f s: %s", backoff, exc)  # NOTE: teardown warns

    def _drop_pair(self) -> None:
        self._pair, self._pair_peer, self._mismatch, self._link = None, None, None, None
        self._active.clear()
        self._aborted.clear()

    def _teardown(self, exc: Exception, task: SendTask | None = None) -> None:
        """Fail every request with records on the current generation (and ``task``'s), and
        drop it."""
        error = failure_text(exc, self._pair.name if self._pair is not None else None)
        log.warning("KV pair torn down: %s", error)
        rids = self._active | ({task.header.request_id} if task is not None else set())
        for rid in rids:
            self._owner.fail(rid, error)
        self._drop_pair()


def _local_heads(layout: KVLayout, rank: int, heads: range | None) -> slice | None:
    """Global pair heads -> slice of this rank's local head axis (None for MLA)."""
    if heads is None:
        return None
    local = layout.heads_of(rank % layout.tp)  # NOTE: CP rank r * tp + t holds t's heads
    return slice(heads.start - local.start, heads.stop - local.start)

"""Decode side: one receiver thread per pair generation.

Loop: wait for the doorbell (blocking in the store; a ``stop`` doorbell ends the wait at once),
whose value is the record's header, then for a data record receive its K, V (and, for
DeepSeek-V3.2, index_k) messages (:mod:`~kv_transfer.cuts`; each receive bounded by
``payload_timeout_s``). A buffer whose cuts are consecutive destination runs is received
straight into the cache rows (no scatter), holding the request's write permission
(:meth:`~kv_transfer.tracker.RequestTracker.begin_write`) for the whole receive, so
``release`` waits for it. Other buffers go into pooled staging buffers, handed to this
channel's scatter thread, which writes them into the destination slots if the tracker still
allows writing the request. Payloads of unknown, failed or released requests are read into
staging and dropped, so the channel stays in step.

Any pair error (dead peer, timeout, bad header) ends the thread and fails the requests the
generation carried records for; the prefill side remakes the pair with a new generation.
A prefill rank that dies or hangs between records is told by its heartbeats stopping
(:meth:`ReceiverChannel.silence`, checked by the connector every ``heartbeat_s``).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

import torch

from kv_transfer import pair as pairs
from kv_transfer import cuts, payload, wire
from kv_transfer.backend import PairBackend
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferError
from kv_transfer.layout import KVLayout
from kv_transfer.tracker import PairGeneration, RequestTracker, TrackedRequest

log = logging.getLogger(__name__)
_SCATTER_DEPTH = 2


@dataclass
class _Targets:
    """Where one data record's messages land.

    Attributes:
        messages: one tensor per wire message, in wire order: cache views (in place) or
            slices of ``buffers``.
        buffers: ``(buffer number in layout order, [Ly, T, *D] staging tensor)`` of the
            buffers not received in place (to scatter).
        raws: the pooled byte buffers under ``buffers``, given back after the scatter.
    """

    messages: list[torch.Tensor]
    buffers: list[tuple[int, torch.Tensor]]
    raws: list[torch.Tensor]


@dataclass
class _Staged:
    """A received record waiting for the scatter thread (``buffers``/``raws`` as in
    :class:`_Targets`; ``nbytes``: payload bytes, for the stats)."""

    request: TrackedRequest
    header: wire.Header
    buffers: list[tuple[int, torch.Tensor]]
    raws: list[torch.Tensor]
    nbytes: int


class ReceiverChannel:
    """Receiver of one generation of pair (prefill ``announce.instance/rank`` -> this rank)."""

    def __init__(self, host: str, port: int, announce: wire.Announce, me: str, rank: int,
                 cache: object, layout: KVLayout, backend: PairBackend,
                 config: TransferConfig, tracker: RequestTracker,
                 stats: payload.PayloadStats) -> None:
        self.source = PairGeneration(f"prefill {announce.instance}/{announce.rank}",
                                     announce.generation)
        self._host, self._port, self._announce, self._me = host, port, announce, me
        self._rank, self._cache, self._layout = rank, cache, layout
        self._backend, self._config = backend, config
        self._tracker, self._stats = tracker, stats
        self._num_slots, self._device = payload.cache_slots(cache)
        # NOTE: one staging buffer per cache buffer per record
        self._pool = payload.BufferPool(keep=len(layout.buffers) * (_SCATTER_DEPTH + 1))
        self._stop = threading.Event()
        self._group: pairs.PairGroup | None = None
        self._idle_since: float | None = None  # waiting for a doorbell since (monotonic s)
        self._beats, self._heard = -1, time.monotonic()
        # NOTE: scatters run on their own thread so the next record's bytes arrive meanwhile;
        # at most _SCATTER_DEPTH received payloads wait (bounds memory).
        self._scatters: queue.Queue[_Staged | None] = queue.Queue(maxsize=_SCATTER_DEPTH)
        self._scatter_thread = threading.Thread(
            target=self._scatter_loop, daemon=True,
            name=f"kv-scatter-{announce.instance}/{announce.rank}-g{announce.generation}->{me}")
        self._scatter_thread.start()
        self._thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"kv-recv-{announce.instance}/{announce.rank}-g{announce.generation}->{me}")
        self._thread.start()

    @property
    def generation(self) -> int:
        return self._announce.generation

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() or self._scatter_thread.is_alive()

    def stop(self, store) -> None:
        """Ask the thread to stop (it finishes the record in flight, bounded); ``store`` is
        a client other than the receiver's, used to wake its doorbell wait."""
        self._stop.set()
        group = self._group
        if group is not None:
            try:
                group.wake(store)
            except Exception:  # noqa: BLE001 - the store is gone: the wait ends with it
                log.debug("could not wake %s", group.name)

    def silence(self, store) -> float:
        """Seconds this receiver has waited for a doorbell while the prefill rank posted no
        heartbeat (0 while a record is received, or before the pair is up); ``store`` is a
        client other than the receiver's. Called by one thread (the acceptor)."""
        group, idle = self._group, self._idle_since
        if group is None or idle is None:
            return 0.0
        beats, now = group.beats(store), time.monotonic()
        if beats != self._beats:
            self._beats, self._heard = beats, now
        return now - max(idle, self._heard)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        self._scatter_thread.join(timeout_s)

    def _run(self) -> None:
        try:
            group = pairs.accept(self._host, self._port, self._announce, self._me,
                                 self._backend, self._config)
            self._group = group
            while not self._stop.is_set():
                self._idle_since = time.monotonic()
                raw = group.wait_doorbell(self._stop)
                self._idle_since = None
                if raw is None:
                    break
                self._receive(group, raw)
        except Exception as exc:  # noqa: BLE001 - the pair is done; tell its requests
            log.warning("KV pair lost: %s", exc)
            self._tracker.on_pair_lost(self.source, f"{self.source.sender} -> decode "
                                       f"{self._me}: pair lost: {exc}")
        finally:
            self._idle_since = None  # NOTE: an ended receiver is silent for a reason already
            self._scatters.put(None)  # the scatter thread drains what was received, then ends

    def _scatter_loop(self) -> None:
        while (item := self._scatters.get()) is not None:
            header = item.header
            local = self._local_heads(header.head_range())
            slots = header.dst_slots.to(self._device)
            t0 = time.perf_counter()

            def scatter() -> None:
                for buffer, staged in item.buffers:
                    payload.scatter(self._cache, buffer, header.layers, local, slots, staged)
            try:
                self._tracker.write(item.request, header, scatter)
            except Exception as exc:  # noqa: BLE001 - fail the request, keep draining
                self._tracker.fail(header.request_id, f"{self.source.sender} -> decode {self._me}: "
                                   f"scatter of request {header.request_id} failed: {exc}")
                continue
            self._return_buffers(item.raws)
            self._stats.add(scatter_s=time.perf_counter() - t0, nbytes=item.nbytes)

    def _receive(self, group: pairs.PairGroup, raw: bytes) -> None:
        header = wire.decode_header(raw)
        if header.kind == wire.DONE:
            self._tracker.on_done(self.source, header)
        elif header.kind == wire.ABORT:
            self._tracker.on_abort(self.source, header)
        else:
            self._receive_data(group, header)

    def _receive_data(self, group: pairs.PairGroup, header: wire.Header) -> None:
        """Receive one data record: in place where allowed, else staged for the scatter
        thread; bytes of a request that may not be written are read and dropped."""
        self._check_fits(group, header)
        req = self._tracker.admit(self.source, header, self._num_slots)
        plans = self._cuts(header)
        in_place = {} if req is None else self._in_place_views(header, plans)
        if in_place and not self._tracker.begin_write(req):
            in_place = {}  # NOTE: released/failed meanwhile: read into staging and drop
        targets = self._targets(header, plans, in_place)
        what = (f"request {header.request_id} layers {header.layers[0]}..{header.layers[-1]} "
                f"tokens [{header.token_start}, {header.token_end})")
        t0 = time.perf_counter()
        done = False
        try:  # NOTE: release() waits for in-place receives: their bytes land in the slots
            group.recv_all(targets.messages, self._config.payload_timeout_s, what)
            done = True
        finally:
            if in_place:
                self._tracker.end_write(req, header, done and not targets.buffers)
        nbytes = sum(t.numel() * t.element_size() for t in targets.messages)
        self._stats.add(wire_s=time.perf_counter() - t0, nbytes=0 if targets.buffers else nbytes)
        if req is None or not targets.buffers:
            self._return_buffers(targets.raws)  # all in place, or may not be written: dropped
        else:  # NOTE: waits while _SCATTER_DEPTH records are queued
            self._scatters.put(_Staged(req, header, targets.buffers, targets.raws, nbytes))

    def _check_fits(self, group: pairs.PairGroup, header: wire.Header) -> None:
        """Raises TransferError (the pair is lost) for a record this cache cannot hold."""
        if header.fingerprint != self._layout.fingerprint():
            raise TransferError(f"{group.name}: data record with layout fingerprint "
                                f"{header.fingerprint}, this rank has "
                                f"{self._layout.fingerprint()}: configs differ", pair=group.name)
        if (len(header.layers) > self._layout.num_layers or header.n_tokens > self._num_slots
                or max(header.layers) >= self._layout.num_layers
                or len(header.head_range() or ()) > (self._layout.num_kv_heads or 0)):
            raise TransferError(f"{group.name}: data record of {header.request_id} with "
                                f"{len(header.layers)} layers x {header.n_tokens} tokens does "
                                f"not fit this cache ({self._layout.num_layers} layers, "
                                f"{self._num_slots} slots)", pair=group.name)

    def _cuts(self, header: wire.Header) -> list[cuts.Cuts]:
        """Per buffer (layout order), the record's message cuts (from its destination slots)."""
        return [cuts.cut(header.dst_slots, self._token_bytes(spec, header))
                for spec in self._layout.buffers]

    def _targets(self, header: wire.Header, plans: list[cuts.Cuts],
                 in_place: dict[int, list[torch.Tensor]]) -> _Targets:
        """Where each message of the record lands, in wire order (buffer after buffer, K, V[,
        index_k]; per layer, per cut): the ``in_place`` cache views, else slices of pooled
        staging buffers."""
        targets = _Targets([], [], [])
        for buffer, spec in enumerate(self._layout.buffers):
            if buffer in in_place:
                targets.messages.extend(in_place[buffer])
                continue
            shape = (len(header.layers), header.n_tokens,
                     *self._layout.token_dims(spec, header.head_range()))
            raw = self._pool.take(math.prod(shape) * self._layout.element_size, self._device)
            buf = payload.as_tensor(raw, shape, self._layout.torch_dtype)
            targets.raws.append(raw)
            targets.buffers.append((buffer, buf))
            targets.messages.extend(buf[i, a:a + n] for i in range(len(header.layers))
                                    for a, n in plans[buffer].ranges)
        return targets

    def _token_bytes(self, spec, header: wire.Header) -> int:
        return math.prod(self._layout.token_dims(spec, header.head_range())) * \
            self._layout.element_size

    def _in_place_views(self, header: wire.Header,
                        plans: list[cuts.Cuts]) -> dict[int, list[torch.Tensor]]:
        """Buffer number -> cache views (per layer, per cut) for the buffers whose cuts are all
        consecutive destination runs (received in place, no scatter)."""
        local = self._local_heads(header.head_range())
        got = {}
        for buffer, plan in enumerate(plans):
            if not plan.in_place:
                continue
            views = []
            for layer in header.layers:
                found = cuts.views(payload.flat(self._cache, buffer, layer, local),
                                   list(plan.dst_starts), plan)
                if found is None:
                    break
                views.extend(found)
            else:
                got[buffer] = views
        return got

    def _return_buffers(self, raws: list[torch.Tensor]) -> None:
        for raw in raws:
            self._pool.give(raw)

    def _local_heads(self, heads: range | None) -> slice | None:
        if heads is None:
            return None
        mine = self._layout.heads_of(self._rank)
        return slice(heads.start - mine.start, heads.stop - mine.start)

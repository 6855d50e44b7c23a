"""Decode side: one receiver thread per pair generation.

Loop: wait for the doorbell (blocking in the store; a ``stop`` doorbell ends the wait at once),
whose value is the record's header, then for a data record receive its K and V messages
(:mod:`~kv_transfer.cuts`; each receive bounded by ``payload_timeout_s``). A buffer
whose cuts are consecutive destination runs is received straight into the cache rows (no
scatter), holding the request's write permission
(:meth:`~kv_transfer.tracker.RequestTracker.begin_write`) for the whole receive, so
``release`` waits for it. Other buffers go into pooled staging buffers, handed to this
channel's scatter thread, which writes them into the destination slots if the tracker still
allows writing the request. Payloads of unknown, failed or released requests are read into
staging and dropped, so the channel stays in step.

Any pair error (dead peer, timeout, bad header) ends the thread and fails the requests the
generation carried records for; the prefill side remakes the pair with a new generation.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time

import torch

from kv_transfer import pair as pairs
from kv_transfer import cuts, payload, wire
from kv_transfer.backend import PairBackend
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferError
from kv_transfer.layout import KVLayout
from kv_transfer.tracker import RequestTracker

log = logging.getLogger(__name__)
_SCATTER_DEPTH = 2


class ReceiverChannel:
    """Receiver of one generation of pair (prefill ``announce.instance/rank`` -> this rank)."""

    def __init__(self, host: str, port: int, announce: wire.Announce, me: str, rank: int,
                 cache: object, layout: KVLayout, backend: PairBackend,
                 config: TransferConfig, tracker: RequestTracker,
                 stats: payload.PayloadStats) -> None:
        self.link = (f"prefill {announce.instance}/{announce.rank}", announce.generation)
        self._host, self._port, self._announce, self._me = host, port, announce, me
        self._rank, self._cache, self._layout = rank, cache, layout
        self._backend, self._config = backend, config
        self._tracker, self._stats = tracker, stats
        self._device = cache.k_caches[0].device
        self._num_slots = cache.k_caches[0].shape[0] * cache.k_caches[0].shape[1]
        self._pool = payload.BufferPool(keep=2 * (_SCATTER_DEPTH + 1))  # K+V per record
        self._stop = threading.Event()
        self._group: pairs.PairGroup | None = None
        # NOTE: scatters run on their own thread so the next record's bytes arrive meanwhile;
        # at most _SCATTER_DEPTH received payloads wait (bounds memory).
        self._scatters: queue.Queue = queue.Queue(maxsize=_SCATTER_DEPTH)
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

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        self._scatter_thread.join(timeout_s)

    def _run(self) -> None:
        try:
            group = pairs.accept(self._host, self._port, self._announce, self._me,
                                 self._backend, self._config)
            self._group = group
            while not self._stop.is_set():
                raw = group.wait_doorbell(self._stop)
                if raw is None:
                    break
                self._receive(group, raw)
        except Exception as exc:  # noqa: BLE001 - the pair is done; tell its requests
            log.warning("KV pair lost: %s", exc)
            self._tracker.on_link_lost(self.link, f"{self.link[0]} -> decode {self._me}: "
                                       f"pair lost: {exc}")
        finally:
            self._scatters.put(None)  # the scatter thread drains what was received, then ends

    def _scatter_loop(self) -> None:
        while (item := self._scatters.get()) is not None:
            req, header, staged, raws, nbytes = item
            local = self._local_heads(header.head_range())
            slots = header.dst_slots.to(self._device)
            t0 = time.perf_counter()

            def scatter() -> None:
                for name, buf in staged:
                    payload.scatter(self._cache, name, header.layers, local, slots, buf)
            try:
                self._tracker.write(req, header, scatter)
            except Exception as exc:  # noqa: BLE001 - fail the request, keep draining
                self._tracker.fail(header.request_id, f"{self.link[0]} -> decode {self._me}: "
                                   f"scatter of request {header.request_id} failed: {exc}")
                continue
            self._give(raws)
            self._stats.add(scatter_s=time.perf_counter() - t0, nbytes=nbytes)

    def _receive(self, group: pairs.PairGroup, raw: bytes) -> None:
        header = wire.decode_header(raw)
        if header.kind == wire.DONE:
            self._tracker.on_done(self.link, header)
        elif header.kind == wire.ABORT:
            self._tracker.on_abort(self.link, header)
        else:
            self._receive_data(group, header)

    def _receive_data(self, group: pairs.PairGroup, header: wire.Header) -> None:
        if header.fingerprint != self._layout.fingerprint():
            raise TransferError(f"{group.name}: data record with layout fingerprint "
                                f"{header.fingerprint}, this rank has "
                                f"{self._layout.fingerprint()}: configs differ")
        if (len(header.layers) > self._layout.num_layers or header.n_tokens > self._num_slots
                or max(header.layers) >= self._layout.num_layers
                or len(header.head_range() or ()) > (self._layout.num_kv_heads or 0)):
            raise TransferError(f"{group.name}: data record of {header.request_id} with "
                                f"{len(header.layers)} layers x {header.n_tokens} tokens does "
                                f"not fit this cache ({self._layout.num_layers} layers, "
                                f"{self._num_slots} slots)")
        req = self._tracker.admit(self.link, header, self._num_slots)
        what = (f"request {header.request_id} layers {header.layers[0]}..{header.layers[-1]} "
                f"tokens [{header.token_start}, {header.token_end})")
        t0 = time.perf_counter()
        plans = {spec.name: cuts.cut(header.dst_slots, self._token_bytes(spec, header))
                 for spec in self._layout.buffers}
        direct = {} if req is None else self._direct_views(header, plans)
        if direct and not self._tracker.begin_write(req):
            direct = {}  # NOTE: released/failed meanwhile: read into staging and drop
        targets, staged, raws = [], [], []
        for spec in self._layout.buffers:  # K then V: per layer, per cut
            if spec.name in direct:
                targets.extend(direct[spec.name])
                continue
            shape = (len(header.layers), header.n_tokens,
                     *self._layout.token_dims(spec, header.head_range()))
            raws.append(self._pool.take(math.prod(shape) * self._layout.element_size,
                                        self._device))
            buf = payload.as_tensor(raws[-1], shape, self._layout.torch_dtype)
            staged.append((spec.name, buf))
            targets.extend(buf[i, a:a + n] for i in range(len(header.layers))
                           for a, n in plans[spec.name].ranges)
        done = False
        try:  # NOTE: release() waits for in-place receives: their bytes land in the slots
            group.recv_all(targets, self._config.payload_timeout_s, what)
            done = True
        finally:
            if direct:
                self._tracker.end_write(req, header, done and not staged)
        nbytes = sum(t.numel() * t.element_size() for t in targets)
        self._stats.add(wire_s=time.perf_counter() - t0, nbytes=0 if staged else nbytes)
        if req is None or not staged:
            self._give(raws)  # all in place, or unknown / failed / released: bytes dropped
        else:
            self._scatters.put((req, header, staged, raws, nbytes))  # waits if _SCATTER_DEPTH

    def _token_bytes(self, spec, header: wire.Header) -> int:
        return math.prod(self._layout.token_dims(spec, header.head_range())) * \
            self._layout.element_size

    def _direct_views(self, header: wire.Header,
                      plans: dict[str, cuts.Cuts]) -> dict[str, list[torch.Tensor]]:
        """Buffer name -> cache views (per layer, per cut) for the buffers whose cuts are all
        consecutive destination runs (received in place, no scatter)."""
        local = self._local_heads(header.head_range())
        got = {}
        for spec in self._layout.buffers:
            plan = plans[spec.name]
            if not plan.in_place:
                continue
            views = []
            for layer in header.layers:
                found = cuts.views(payload.flat(self._cache, spec.name, layer, local),
                                   list(plan.dst_starts), plan)
                if found is None:
                    break
                views.extend(found)
            else:
                got[spec.name] = views
        return got

    def _give(self, raws: list[torch.Tensor]) -> None:
        for raw in raws:
            self._pool.give(raw)

    def _local_heads(self, heads: range | None) -> slice | None:
        if heads is None:
            return None
        mine = self._layout.heads_of(self._rank)
        return slice(heads.start - mine.start, heads.stop - mine.start)

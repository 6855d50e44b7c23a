"""Decode side: one receiver thread per pair generation.

Loop: wait for the doorbell (blocking in the store; a ``stop`` doorbell ends the wait at once),
whose value is the record's header, then for a data record receive its payload
(:mod:`~kv_transfer.packs`; each wait bounded by ``payload_timeout_s``) while holding the
request's write permission (:meth:`~kv_transfer.tracker.RequestTracker.begin_write`), so
``release`` waits for it: its view messages straight into the cache rows (no scatter), then
its packs one by one, each scattered into the destination slots while the next ones arrive
(over the network, or from the pair's same-node segment: :mod:`~kv_transfer.links`).
Payloads of unknown, failed or released requests are read and dropped, so the channel stays
in step.

Any pair error (dead peer, timeout, bad header) ends the thread and fails the requests the
generation carried records for; the prefill side remakes the pair with a new generation.
A prefill rank that dies or hangs between records is told by its heartbeats stopping
(:meth:`ReceiverChannel.silence`, checked by the connector every ``heartbeat_s``).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from kv_transfer import links, local, packs, payload, wire
from kv_transfer import pair as pairs
from kv_transfer.backend import PairBackend
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferError, WireError
from kv_transfer.layout import KVLayout
from kv_transfer.tracker import PairGeneration, RequestTracker

log = logging.getLogger(__name__)


class ReceiverChannel:
    """Receiver of one generation of pair (prefill ``announce.instance/rank`` -> this rank).

    ``segment``: the same-node segment (uint8 tensor, handle) named in this generation's ack,
    or None; it is used if the prefill rank mapped it, and its name is unlinked once the
    group is built or failed.
    """

    def __init__(self, host: str, port: int, announce: wire.Announce, me: str, rank: int,
                 cache: object, layout: KVLayout, backend: PairBackend,
                 config: TransferConfig, tracker: RequestTracker,
                 stats: payload.PayloadStats,
                 segment: tuple[torch.Tensor, bytes] | None = None) -> None:
        self.source = PairGeneration(f"prefill {announce.instance}/{announce.rank}",
                                     announce.generation)
        self._host, self._port, self._announce, self._me = host, port, announce, me
        self._rank, self._cache, self._layout = rank, cache, layout
        self._backend, self._config = backend, config
        self._tracker, self._stats = tracker, stats
        self._num_slots, self._device = payload.cache_slots(cache)
        self._segment = segment
        self._link: links.NetReceiver | links.LocalReceiver | None = None
        self._stop = threading.Event()
        self._group: pairs.PairGroup | None = None
        self._idle_since: float | None = None  # waiting for a doorbell since (monotonic s)
        self._beats, self._heard = -1, time.monotonic()
        self._thread = threading.Thread(
            target=self._run, daemon=True,
            name=f"kv-recv-{announce.instance}/{announce.rank}-g{announce.generation}->{me}")
        self._thread.start()

    @property
    def generation(self) -> int:
        return self._announce.generation

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, store, abort: bool = False) -> None:
        """Ask the thread to stop (it finishes the record in flight, bounded); ``store`` is
        a client other than the receiver's, used to wake its doorbell wait. ``abort``: the
        peer is dead or hung, so the group's communicator is aborted too
        (:meth:`PairGroup.abort`: NCCL/HCCL; nothing for gloo)."""
        self._stop.set()
        group = self._group
        if group is not None and abort:
            group.abort()
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

    def _run(self) -> None:
        try:
            group = self._accept()
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
            if self._group is not None:
                self._group.abort()
            self._tracker.on_pair_lost(self.source, f"{self.source.sender} -> decode "
                                       f"{self._me}: pair lost: {exc}")
        finally:
            self._idle_since = None  # NOTE: an ended receiver is silent for a reason already

    def _accept(self) -> pairs.PairGroup:
        """Join the pair's group and pick its pack transport; the segment's name is unlinked
        either way (both ranks mapped it, or it will not be used)."""
        segment = None if self._segment is None else self._segment[0]
        try:
            group = pairs.accept(self._host, self._port, self._announce, self._me,
                                 self._backend, self._config, segment)
        finally:
            if self._segment is not None:
                local.local_backend(self._device).unlink(self._segment[1])
                self._segment = None  # NOTE: the group holds the mapping if it is used
        timeout_s = self._config.payload_timeout_s
        self._link = links.NetReceiver(group, self._device, timeout_s) if group.local is None \
            else links.LocalReceiver(group, group.local, self._device, timeout_s)
        return group

    def _receive(self, group: pairs.PairGroup, raw: bytes) -> None:
        header = wire.decode_header(raw)
        if header.kind == wire.DONE:
            self._tracker.on_done(self.source, header)
        elif header.kind == wire.ABORT:
            self._tracker.on_abort(self.source, header)
        else:
            self._receive_data(group, header)

    def _receive_data(self, group: pairs.PairGroup, header: wire.Header) -> None:
        """Receive one data record into its chunk's slots while holding the request's write
        permission (``release`` waits for it); bytes of a chunk that may not be written are
        read and dropped, so the pair stays in step."""
        chunk = header.chunk
        self._check_fits(group, header)
        req = self._tracker.admit(self.source, header.prefill_rank, chunk, self._num_slots)
        allowed = req is not None and self._tracker.begin_write(req)
        what = (f"request {chunk.request_id} layers {chunk.layers[0]}..{chunk.layers[-1]} "
                f"tokens [{chunk.token_start}, {chunk.token_end})")
        t0, done, scatter_s = time.perf_counter(), False, 0.0
        try:
            scatter_s = self._receive_views(group, header, allowed, what)
            packed_s, done = self._receive_packs(header, allowed, what)
            scatter_s += packed_s
        finally:
            if allowed:
                self._tracker.end_write(req, chunk, done)
        nbytes = chunk.n_tokens * self._layout.token_layer_bytes(chunk.layers, chunk.head_range())
        self._stats.add(wire_s=time.perf_counter() - t0 - scatter_s, scatter_s=scatter_s,
                        nbytes=nbytes if allowed else 0)

    def _receive_packs(self, header: wire.Header, allowed: bool,
                       what: str) -> tuple[float, bool]:
        """Receive a record's packs, scattering each while the next ones arrive;
        returns (scatter seconds, every pack written). A failed scatter fails the request;
        the rest of its packs are read and dropped."""
        frames = packs.packs(self._layout, header)
        local = self._local_heads(header.chunk.head_range())
        dst = header.chunk.dst_slots.to(self._device)
        scatter_s, ok = 0.0, allowed
        # NOTE: driven to its end (not zip-ped with frames): the link acks / recycles the
        # last pack only when asked for the next one
        for i, got in enumerate(self._link.receive([p.nbytes for p in frames], what)):
            pack = frames[i]
            if not ok:
                continue
            t0 = time.perf_counter()
            try:
                packs.scatter(self._cache, self._layout, header, local, dst, pack, got)
            except Exception as exc:  # noqa: BLE001 - fail the request, keep the pair in step
                ok = False
                self._tracker.fail(header.request_id, f"{self.source.sender} -> decode "
                                   f"{self._me}: scatter of {what} failed: {exc}")
            scatter_s += time.perf_counter() - t0
        return scatter_s, ok

    def _receive_views(self, group: pairs.PairGroup, header: wire.Header, allowed: bool,
                       what: str) -> float:
        """Receive the record's view messages straight into the cache rows, or through a
        temporary copy where those rows are not contiguous (a GQA head subset); read and
        dropped when not ``allowed``. Returns the copy seconds.

        Raises:
            WireError: the cuts split no run of the destination slots.
        """
        if not header.views:
            return 0.0
        try:
            rows = packs.cut_views(self._cache, self._layout, header,
                                   self._local_heads(header.chunk.head_range()),
                                   header.chunk.dst_slots)
        except ValueError as exc:
            raise WireError(f"{group.name}: {what}: {exc}: the sender breaks the protocol",
                            pair=group.name) from exc
        messages = [t if allowed and t.is_contiguous() else
                    torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in rows]
        group.recv_all(messages, self._config.payload_timeout_s, what)
        copies = [(t, m) for t, m in zip(rows, messages) if m is not t] if allowed else []
        t0 = time.perf_counter()
        for target, got in copies:
            target.copy_(got)
        return time.perf_counter() - t0 if copies else 0.0

    def _check_fits(self, group: pairs.PairGroup, header: wire.Header) -> None:
        """Raises TransferError (the pair is lost) for a record this cache cannot hold."""
        if header.fingerprint != self._layout.fingerprint():
            raise TransferError(f"{group.name}: data record with layout fingerprint "
                                f"{header.fingerprint}, this rank has "
                                f"{self._layout.fingerprint()}: configs differ", pair=group.name)
        c = header.chunk
        if (len(c.layers) > self._layout.num_layers or c.n_tokens > self._num_slots
                or max(c.layers) >= self._layout.num_layers
                or len(c.head_range() or ()) > (self._layout.num_kv_heads or 0)):
            raise TransferError(f"{group.name}: data record of {header.request_id} with "
                                f"{len(c.layers)} layers x {c.n_tokens} tokens does "
                                f"not fit this cache ({self._layout.num_layers} layers, "
                                f"{self._num_slots} slots)", pair=group.name)

    def _local_heads(self, heads: range | None) -> slice | None:
        if heads is None:
            return None
        mine = self._layout.heads_of(self._rank)
        return slice(heads.start - mine.start, heads.stop - mine.start)

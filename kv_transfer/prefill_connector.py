"""Prefill rank side of the KV transfer: what the prefill worker calls, per rank.

Per request the worker calls, in order: ``send_chunk`` after each computed chunk (non-blocking:
records are queued on per-peer sender threads), ``finish`` after the last chunk (``done``
records), then ``poll`` (or ``wait``) until the request is no longer TRANSFERRING before
freeing its source blocks; or ``abort`` at any time (queued records dropped, ``abort`` records
sent), likewise followed by ``poll`` / ``wait`` (:class:`~kv_transfer.status.KVPoll`).

``peers`` is the decode instance's ranks in rank order, one :class:`~kv_transfer.KVPeer`
each, with ``(host, port)`` the address each ``DecodeKVConnector`` published. Which decode
ranks this rank sends to, and which layers/heads/tokens, comes from :func:`build_transfer_plan`
(``prefill tp = tp``, ``prefill cp = cp``, ``decode tp = len(peers)``): with context-parallel
prefill each rank ships, of every chunk, only the token pieces its CP rank computed (one
:class:`~kv_transfer.chunk.KVChunk` per piece and pair).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kv_transfer import wire
from kv_transfer.backend import backend_for
from kv_transfer.chunk import KVChunk
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferError
from kv_transfer.layout import KVLayout
from kv_transfer.payload import PayloadStats, cache_slots, check_cache
from kv_transfer.peer import KVPeer
from kv_transfer.plan import PairPlan, TransferPlan, build_transfer_plan
from kv_transfer.sender import SenderChannel, SendOwner, SendTask
from kv_transfer.status import KVPoll, KVStatus

_MAX_OUTCOMES = 10_000  # remembered ended requests (oldest forgotten first)
# NOTE: of two outcomes of one request the stronger stays (a failure after finish or abort)
_STRENGTH = {KVPoll.SUCCESS: 0, KVPoll.ABORTED: 1, KVPoll.FAILED: 2}


class _SendProgress(SendOwner):
    """Per-request state of one prefill rank's sends (thread-safe): how many data and
    ``done`` records are queued or in flight, and how the request ended (finished, aborted
    or failed; the newest ``_MAX_OUTCOMES`` requests).

    NOTE: ``abort`` records are not counted: they touch no slot, and an abort must not wait
    behind another request's connect to a dead decode rank.
    """

    def __init__(self) -> None:
        self._pending: dict[str, int] = {}
        self._outcomes: OrderedDict[str, KVStatus] = OrderedDict()
        self._cond = threading.Condition()

    def queued(self, header: wire.Header) -> None:
        """The record is queued (its channel, or ``cancel``, reports it finished)."""
        if header.kind == wire.ABORT:
            return
        with self._cond:
            self._pending[header.request_id] = self._pending.get(header.request_id, 0) + 1

    def end(self, request_id: str, status: KVStatus) -> None:
        """The request finished, was aborted or failed (the strongest outcome stays)."""
        with self._cond:
            old = self._outcomes.get(request_id)
            if old is None or _STRENGTH[status.state] > _STRENGTH[old.state]:
                self._outcomes[request_id] = status
            while len(self._outcomes) > _MAX_OUTCOMES:
                self._outcomes.popitem(last=False)

    def poll(self, request_id: str) -> KVStatus:
        with self._cond:
            return self._poll(request_id)

    def wait(self, request_id: str, timeout_s: float) -> KVStatus:
        """Wait up to ``timeout_s`` until no record of ``request_id`` is queued or in flight;
        returns its status then (TRANSFERRING when the wait ran out)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending.get(request_id, 0):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._poll(request_id)

    def _poll(self, request_id: str) -> KVStatus:
        if self._pending.get(request_id, 0):
            return KVStatus(KVPoll.TRANSFERRING)
        return self._outcomes.get(request_id, KVStatus(KVPoll.WAITING))

    def failure(self, request_id: str) -> str | None:
        with self._cond:
            status = self._outcomes.get(request_id)
        return status.error if status is not None and status.state is KVPoll.FAILED else None

    def fail(self, request_id: str, error: str) -> None:
        self.end(request_id, KVStatus(KVPoll.FAILED, error))

    def finished(self, header: wire.Header) -> None:
        if header.kind == wire.ABORT:
            return
        with self._cond:
            rid = header.request_id
            self._pending[rid] -= 1
            if not self._pending[rid]:
                del self._pending[rid]
                self._cond.notify_all()


class PrefillKVConnector:
    """KV sender of one prefill rank (see module docstring for the call order). Its methods
    are called by one thread (the rank's), its sender threads report through ``_progress``.

    Args:
        kv_cache: the rank's ``KVCache`` (or any object whose ``layer_buffers(layer)`` gives
            the buffers ``layout`` names, see :mod:`~kv_transfer.payload`).
        layout: this instance's :class:`KVLayout` (``layout.tp == tp``).
        instance, rank, tp: this rank's identity (``rank`` in ``[0, cp * tp)``, CP rank
            ``rank // tp``).
        config: bounded waits.
        cp: context-parallel size of the instance.

    Raises:
        ValueError: ``layout.tp != tp``, or ``kv_cache`` does not hold the buffers ``layout``
            names.
    """

    def __init__(self, kv_cache: object, layout: KVLayout, instance: str, rank: int, tp: int,
                 config: TransferConfig, cp: int = 1) -> None:
        if layout.tp != tp:
            raise ValueError(f"layout.tp ({layout.tp}) != tp ({tp}): build the layout for "
                             "this instance")
        check_cache(kv_cache, layout, layout.heads_of(rank % tp))
        self._cache, self._layout, self._config = kv_cache, layout, config
        self._instance, self._rank, self._tp, self._cp = instance, rank, tp, cp
        self._device = cache_slots(kv_cache)[1]
        self._backend = backend_for(self._device)
        self._fingerprint = layout.fingerprint()
        self._channels: dict[tuple[str, int], SenderChannel] = {}
        self._plans: dict[int, TransferPlan] = {}
        self._progress = _SendProgress()
        self._aborted: OrderedDict[str, None] = OrderedDict()  # newest _MAX_OUTCOMES
        self.stats = PayloadStats()
        self._closed = False

    def plan(self, decode_tp: int) -> TransferPlan:
        """The transfer plan between this instance and a decode instance of ``decode_tp``."""
        if decode_tp not in self._plans:
            lay = self._layout
            self._plans[decode_tp] = build_transfer_plan(self._tp, decode_tp, lay.num_layers,
                                                         lay.kind, lay.num_kv_heads, self._cp)
        return self._plans[decode_tp]

    def send_chunk(self, request_id: str, peers: Sequence[KVPeer], token_start: int,
                   token_end: int, src_slots: torch.Tensor, dst_slots: torch.Tensor,
                   layers: Sequence[int] | None = None, written: object | None = None) -> None:
        """Queue this rank's planned layers of tokens ``[token_start, token_end)`` (with CP:
        of its pieces of them, :meth:`TransferPlan.token_ranges`).

        Args:
            src_slots: int64 ``[T]`` slots of those tokens in this rank's cache; the blocks
                must stay allocated while :meth:`poll` says TRANSFERRING.
            dst_slots: int64 ``[T]`` slots of the same tokens in the decode cache.
            layers: only these of the planned layers (one layer just written, layer by
                layer); None: every planned layer.
            written: on a device, the event after which those layers may be read
                (:func:`~kv_transfer.layer_ready.mark_written`); None on CPU or when the
                forward that wrote them has finished.

        Ignored after ``abort``; with ``layers``, also once the request failed (its next
        layers go nowhere).

        Raises:
            ValueError: slot counts differ from the token range.
        """
        n = token_end - token_start
        if not 0 <= token_start < token_end or src_slots.numel() != n or dst_slots.numel() != n:
            raise ValueError(f"send_chunk({request_id!r}): tokens [{token_start}, {token_end}) "
                             f"with {src_slots.numel()} src and {dst_slots.numel()} dst slots")
        if request_id in self._aborted:
            return  # NOTE: a chunk that raced with abort(): nothing more goes out
        if layers is not None and self._progress.failure(request_id) is not None:
            return  # NOTE: finish() still queues its done records (each becomes an abort)
        src = src_slots.to(device=self._device, dtype=torch.int64)
        dst = dst_slots.to(device="cpu", dtype=torch.int64)
        planned = self._planned(peers)
        if not planned:
            return
        ranges = self.plan(len(peers)).token_ranges(self._rank, token_start, token_end)
        for pp, peer in planned:
            mine = pp.layers if layers is None else tuple(x for x in pp.layers if x in layers)
            if not mine:
                continue
            heads = None if pp.heads is None else (pp.heads.start, pp.heads.stop)
            for a, b in ranges:
                cells = slice(a - token_start, b - token_start)
                chunk = KVChunk(request_id, mine, a, b, dst[cells], heads, src[cells])
                self._enqueue(SendTask(wire.data_header(chunk, self._rank, self._fingerprint),
                                       peer, written))

    def finish(self, request_id: str, peers: Sequence[KVPeer], num_tokens: int,
               forward_end: float = 0.0, draft_hidden: bytes = b"") -> None:
        """Queue ``done`` records (all ``num_tokens`` sent) to every planned decode rank; the
        request is SUCCESS once they and every data record left. ``forward_end``:
        ``time.time()`` at the end of the forward of the last chunk (the decode side's
        ``kv_tail_s`` starts there; 0.0: not measured). ``draft_hidden``: MTP, fp32 bytes of
        the last prompt position's hidden state (``wire.Header.draft_hidden``). Ignored after
        ``abort``."""
        if request_id in self._aborted:
            return
        for _, peer in self._planned(peers):
            self._enqueue(SendTask(self._record(wire.DONE, request_id, num_tokens=num_tokens,
                                                forward_end=forward_end,
                                                draft_hidden=draft_hidden), peer))
        self._progress.end(request_id, KVStatus(KVPoll.SUCCESS))

    def abort(self, request_id: str, peers: Sequence[KVPeer],
              reason: str = "aborted by prefill") -> None:
        """Drop queued records of the request (also one waiting for a connect) and queue
        ``abort`` records to planned ranks (sent only on a pair that is up); the request is
        ABORTED (unless it failed) once no record is in flight any more (bounded).
        """
        self._aborted[request_id] = None
        while len(self._aborted) > _MAX_OUTCOMES:
            self._aborted.popitem(last=False)
        self._progress.end(request_id, KVStatus(KVPoll.ABORTED, reason))
        for channel in list(self._channels.values()):
            for task in channel.cancel(request_id):
                self._progress.finished(task.header)
        for _, peer in self._planned(peers):
            self._enqueue(SendTask(self._record(wire.ABORT, request_id, error=reason), peer))

    def poll(self, request_id: str) -> KVStatus:
        """The request's state on this rank (:class:`~kv_transfer.status.KVPoll`): its source
        slots may be reused, and nothing more lands in its destination slots, once it is not
        TRANSFERRING (``abort`` records may still be queued). A record to a decode rank that
        cannot be reached fails the request at once (see :mod:`~kv_transfer.sender`, Dead
        peers)."""
        return self._progress.poll(request_id)

    def wait(self, request_id: str, timeout_s: float | None = None) -> KVStatus:
        """:meth:`poll` once the request is not TRANSFERRING, or after ``timeout_s`` (default
        ``completion_timeout_s``), whichever comes first."""
        timeout_s = self._config.completion_timeout_s if timeout_s is None else timeout_s
        return self._progress.wait(request_id, timeout_s)

    def close(self) -> None:
        """Stop all sender threads (each finishes its record in flight and, on a same-node
        pair, waits for the decode rank's acks of its packs; bounded)."""
        self._closed = True
        bound = self._config.payload_timeout_s + self._config.connect_timeout_s
        for channel in list(self._channels.values()):
            channel.close(bound)
        self._channels.clear()

    def _planned(self, peers: Sequence[KVPeer]) -> list[tuple[PairPlan, KVPeer]]:
        """This rank's planned pairs with the decode rank each goes to.

        Raises:
            ValueError: ``peers`` is not decode ranks 0..n-1 in order.
        """
        if [p.rank for p in peers] != list(range(len(peers))):
            raise ValueError(f"peers must list decode ranks 0..{len(peers) - 1} in order, "
                             f"got ranks {[p.rank for p in peers]}")
        return [(pp, peers[pp.decode_rank]) for pp in self.plan(len(peers)).sends_from(self._rank)]

    def _record(self, kind: str, request_id: str, **fields) -> wire.Header:
        return wire.Header(kind=kind, request_id=request_id, prefill_rank=self._rank,
                           fingerprint=self._fingerprint, **fields)

    def _enqueue(self, task: SendTask) -> None:
        if self._closed:
            raise TransferError(f"prefill {self._instance}/{self._rank}: connector is closed")
        self._progress.queued(task.header)
        self._channel(task.peer).put(task)

    def _channel(self, peer: KVPeer) -> SenderChannel:
        key = (peer.instance, peer.rank)
        if key not in self._channels:
            self._channels[key] = SenderChannel(
                self._cache, self._layout, self._instance, self._rank, self._backend,
                self._config, self.stats, self._progress,
                f"{self._instance}/{self._rank}->{peer.instance}/{peer.rank}")
        return self._channels[key]

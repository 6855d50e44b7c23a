"""What every prefill rank does with KV: it queues its planned layers of the step's chunks to
their decode peers, layer by layer while the forward runs (:class:`LayerSends`, called right
after each layer's KV write: layer ``l`` moves while layer ``l + 1`` computes), or all at once
right after the model step (``TransferConfig.layerwise`` off); completion records after a
request's last chunk; and a per-pair record of what it sent (prefill_worker/transfer_log.py).
Sending is asynchronous either way (the connector's sender threads).

The leader says where each chunk goes (:func:`chunk_transfers`, made once per step and carried
to every rank as the step's inputs); each rank sends the layers the transfer plan gives it.

DeepSeek-V4 (a runner with ``stage_rows``): after each chunk's step, the staging rows that
chunk made final (compressed entries, indexer keys and final-window rows as computed, the
open-group state with the last chunk: engine/v4/row_layout.py) are staged into the request's
slots and ship (:func:`staged_transfers`; docs/kv_transfer.md "DeepSeek-V4"). Every TP rank
holds the whole state; each stages only the layers the plan has it send.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.block_pool import slot_mapping
from engine.scheduler import SchedulerOutput
from engine.spec_decode import SpecOutput
from engine.v4.row_layout import RowRange
from kv_transfer import KVPeer, KVPoll, PrefillKVConnector
from kv_transfer.layer_ready import mark_written
from prefill_worker.transfer_log import TransferLog
from rank.config import InstanceConfig
from rank.kv_setup import make_layout
from rank.messages import Reservation, TransferRecord


@dataclass(frozen=True)
class ChunkTransfer:
    """KV of tokens ``[start, end)`` of one request, to go to its decode reservation.

    Attributes:
        request_id: the request.
        peers: the decode ranks (from the reservation).
        start, end: token positions.
        src_slots: int64 ``[end - start]`` slots in this instance's cache.
        dst_slots: int64 ``[end - start]`` slots in the decode instance's cache.
        last: the chunk completes the prompt: send completion records after it.
        row: the chunk's index in the step (``SchedulerOutput.chunks``, ``SpecOutput.hidden``).
        layers: only these layers (None: every layer; DeepSeek-V4: the layers whose staging
            rows ``[start, end)`` the chunk made final).
        prompt_tokens: DeepSeek-V4: ``start`` / ``end`` are staging rows of a request of this
            many prompt tokens (0: token positions).
    """

    request_id: str
    peers: tuple[KVPeer, ...]
    start: int
    end: int
    src_slots: object
    dst_slots: object
    last: bool
    row: int = 0
    layers: tuple[int, ...] | None = None
    prompt_tokens: int = 0


def chunk_transfers(out: SchedulerOutput, reservations: dict[str, Reservation],
                    block_size: int) -> list[ChunkTransfer]:
    """Where each scheduled chunk's KV goes (``block_size``: this instance's).

    Only tokens the decode side does not hold are shipped (``Reservation.num_cached_tokens``,
    its prefix cache): a chunk's range is cut to start there, and the first chunk computed
    here also carries the tokens this instance found in its own prefix cache and the decode
    side lacks (``[held, request.num_cached_tokens)``, read from cached blocks the request
    holds). A chunk left with nothing to ship is skipped (never the last: decode holds at most
    ``prompt - 1`` tokens). A chunk of a request without a reservation yet (launched while
    decode reserves) ships nothing now: :func:`late_transfer` sends it once one arrives.
    """
    plans = []
    for row, c in enumerate(out.chunks):
        res = reservations.get(c.request.request_id)
        if res is None:
            continue
        held = res.num_cached_tokens
        start = held if c.start == c.request.num_cached_tokens else max(held, c.start)
        if start >= c.end:
            continue
        plans.append(ChunkTransfer(
            c.request.request_id, res.peers, start, c.end,
            slot_mapping(c.request.blocks.block_ids, start, c.end, block_size),
            slot_mapping(res.block_ids, start, c.end, res.block_size), c.completes, row))
    return plans


def late_transfer(request_id: str, block_ids, end: int, res: Reservation, block_size: int,
                  last: bool) -> ChunkTransfer | None:
    """The KV of tokens ``[res.num_cached_tokens, end)`` of a request computed before its
    reservation arrived (``block_ids``: its blocks here, ``block_size`` this instance's;
    ``last``: the prompt is complete, completion records follow); None when there is
    nothing to ship."""
    start = res.num_cached_tokens
    if start >= end:
        return None
    return ChunkTransfer(request_id, res.peers, start, end,
                         slot_mapping(block_ids, start, end, block_size),
                         slot_mapping(res.block_ids, start, end, res.block_size), last)


def staged_transfers(out: SchedulerOutput, reservations: dict[str, Reservation],
                     block_size: int, chunk_rows) -> list[ChunkTransfer]:
    """DeepSeek-V4: per scheduled chunk, one transfer per group of layers whose staging rows
    the chunk made final (``chunk_rows(prompt, start, end)``: the runner's
    :meth:`~engine.v4.runner.V4Runner.chunk_rows`: a layer's own rows only), from and to those
    rows of the request's slots on both sides (its scheduler blocks hold
    ``staged_rows(prompt)`` rows, the most a layer ships); the last
    transfer of the chunk that completes the prompt carries ``last``."""
    plans = []
    for row, c in enumerate(out.chunks):
        rid = c.request.request_id
        res = reservations.get(rid)
        if res is None:
            continue
        n = c.request.num_prompt_tokens
        ranges = chunk_rows(n, c.start, c.end)
        for k, rows in enumerate(ranges):
            plans.append(ChunkTransfer(
                rid, res.peers, rows.start, rows.end,
                slot_mapping(c.request.blocks.block_ids, rows.start, rows.end, block_size),
                slot_mapping(res.block_ids, rows.start, rows.end, res.block_size),
                c.completes and k == len(ranges) - 1, row, rows.layers, n))
    return plans


def draft_hidden(output: object, row: int) -> bytes:
    """MTP: fp32 bytes of ``output.hidden[row][-1]`` (``[hidden]``, the main model's normed
    hidden state at the last row of chunk ``row``: the last prompt position, what the decode
    side's first MTP draft starts from); b"" when ``output`` is not a :class:`SpecOutput`."""
    if not isinstance(output, SpecOutput):
        return b""
    return output.hidden[row][-1].float().cpu().contiguous().numpy().tobytes()


class LayerSends:
    """The forward's hook of one step (``AttentionMetadata.on_kv_written``): called with
    layer ``l`` right after ``l``'s KV write, it queues layer ``l`` of every chunk of the step
    (this rank's share of the plan) to the sender threads and returns; on a device the
    copies wait for an event recorded here (:mod:`kv_transfer.layer_ready`).

    A request aborted or failed meanwhile gets nothing more from the next layer on (the
    connector drops it). ``layers_queued``: layers this hook was called for.
    """

    def __init__(self, connector: PrefillKVConnector, transfers: list[ChunkTransfer],
                 device) -> None:
        self.connector, self.device, self.layers_queued = connector, device, 0
        # NOTE: source slots moved to the cache's device once per step, not once per layer
        self.transfers = [(t, t.src_slots.to(device)) for t in transfers]

    def __call__(self, layer: int) -> None:
        written = mark_written(self.device)
        for t, src in self.transfers:
            self.connector.send_chunk(t.request_id, t.peers, t.start, t.end, src,
                                      t.dst_slots, layers=(layer,), written=written)
        self.layers_queued += 1


class KVSends:
    """One prefill rank's KV connector and transfer log.

    Args:
        runner: the rank's model runner (its KV cache and spec).
        cfg: the instance's config (``transfer.layerwise``: send layer by layer).
        rank: this rank.
    """

    def __init__(self, runner, cfg: InstanceConfig, rank: int) -> None:
        self.name, self.rank = cfg.name, rank
        self.kv_spec = runner.kv_spec
        self.device = runner.kv_cache.device
        # NOTE: DeepSeek-V4 stages its rows after each chunk's step (no per-layer stream)
        self.stage = getattr(runner, "stage_rows", None)
        self.staged_rows = getattr(runner, "staged_rows", None)
        self.layerwise = cfg.transfer.layerwise and self.stage is None
        self.connector = PrefillKVConnector(
            runner.kv_cache, make_layout(runner, cfg), cfg.name, rank, cfg.parallel.tp,
            cfg.transfer, cp=cfg.parallel.cp)
        self.log = TransferLog()
        self._layer_sends: LayerSends | None = None  # of the step in progress

    def layer_hook(self, transfers: list[ChunkTransfer] | None) -> LayerSends | None:
        """The forward's per-layer hook for a step with ``transfers`` (None: layer by layer
        is off, or the step has nothing to send). Called before the step, on its thread."""
        self._layer_sends = None
        if self.layerwise and transfers:
            self._layer_sends = LayerSends(self.connector, transfers, self.device)
        return self._layer_sends

    def queue(self, transfers: list[ChunkTransfer] | None, output: object = None) -> None:
        """After the step: queue this rank's planned layers of each chunk that the forward
        did not send layer by layer; completion records after a request's last chunk, with
        MTP (``output`` a :class:`SpecOutput`) carrying the last prompt position's hidden
        state (:func:`draft_hidden`)."""
        forward_end = time.time()
        hook, self._layer_sends = self._layer_sends, None
        # NOTE: a forward that did not call the hook for every layer (one that ignores it)
        # leaves nothing unsent: the whole chunk goes now (decode counts a cell once)
        sent = hook is not None and hook.layers_queued >= self.kv_spec.num_layers
        for t in transfers or ():
            if t.prompt_tokens:  # NOTE: V4: only the layers this rank sends
                plan = self.connector.plan(len(t.peers))
                self.stage(t.request_id, t.prompt_tokens,
                           RowRange(t.start, t.end, t.layers), t.src_slots,
                           {i for send in plan.sends_from(self.rank) for i in send.layers})
            self._queue_one(t, sent, forward_end, output)

    def send_late(self, transfer: ChunkTransfer) -> None:
        """Queue this rank's planned layers of ``transfer``, KV computed before the request's
        reservation arrived (no step in progress: the leader holds its lock)."""
        self._queue_one(transfer, False, time.time(), None)

    def _queue_one(self, t: ChunkTransfer, sent: bool, forward_end: float,
                   output: object) -> None:
        """One transfer: its layers (unless ``sent`` layer by layer), its log entry, and
        completion records after the last chunk."""
        if not sent:
            self.connector.send_chunk(t.request_id, t.peers, t.start, t.end, t.src_slots,
                                      t.dst_slots, layers=t.layers)
        plan = self.connector.plan(len(t.peers))
        tokens = sum(b - a for a, b in plan.token_ranges(self.rank, t.start, t.end))
        for send in plan.sends_from(self.rank):
            pair = f"{self.name}:{self.rank}->{t.peers[send.decode_rank].instance}:" \
                   f"{send.decode_rank}"
            layers = [i for i in send.layers if t.layers is None or i in t.layers]
            if layers:
                self.log.add(t.request_id, pair,
                             self.kv_spec.bytes_per_token_of(layers) * tokens)
        if t.last:  # NOTE: V4: staged_rows (the most a layer ships), whichever range came last
            total = self.staged_rows(t.prompt_tokens) if t.prompt_tokens else t.end
            self.connector.finish(t.request_id, t.peers, total, forward_end,
                                  draft_hidden(output, t.row))

    def idle(self, request_ids: list[str], timeout_s: float) -> dict[str, bool]:
        """request id -> True when no send of it is queued or in flight on this rank (waits
        up to ``timeout_s`` for each); an idle request's transfer record is closed."""
        out = {}
        for rid in request_ids:
            status = self.connector.wait(rid, timeout_s)
            out[rid] = not status.busy
            if not status.busy:
                self.log.close(rid, ok=status.state is not KVPoll.FAILED)
        return out

    def abort(self, request_id: str, peers: tuple[KVPeer, ...]) -> None:
        """Cancel the request's queued sends and tell its decode peers."""
        self.connector.abort(request_id, peers)

    def bytes_sent(self) -> int:
        """K + V payload bytes this rank has sent."""
        return self.connector.stats.snapshot()["bytes"]

    def take_log(self) -> tuple[TransferRecord, ...]:
        """This rank's closed per-pair transfer records since the last call."""
        return self.log.take()

    def close(self) -> None:
        self.connector.close()

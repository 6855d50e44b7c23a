"""Decode side: what each expected request still needs, and whether its slots may be written.

Per request: one bool mask ``[num_layers, num_tokens]`` of (layer, token) cells received over
all the pairs feeding this decode rank (each record's layers checked against its pair's plan),
and which planned prefill ranks' ``done`` records arrived. Complete = the mask full and every
``done`` in. One mask, not one per pair: with a context-parallel prefill a pair carries only
the tokens its rank computed, which depend on the prefill's chunking (kv_transfer/plan.py).
A layer may expect fewer cells than ``num_tokens`` (``layer_tokens``: DeepSeek-V4's staging
rows, each layer its kind's own count, docs/kv_transfer.md "DeepSeek-V4"): its cells past
them are never shipped (pre-marked, not counted as missing) and a record reaching them fails
the request; without it every layer expects ``num_tokens`` (MLA, V3.2's index_k).

Write guarantee: payload bytes are written into a request's slots only by a scatter or an
in-place receive that started while the request was active (expected, not failed, not past
its deadline, not released), and :meth:`RequestTracker.release` waits for the running ones.
So once it returns, no byte is ever written into the request's slots again and the blocks
may be freed, whatever the prefill side still has in flight (those bytes are read off the
wire and dropped).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv_transfer import wire
from kv_transfer.chunk import KVChunk
from kv_transfer.config import TransferConfig
from kv_transfer.layout import KVLayout
from kv_transfer.plan import PairPlan, build_transfer_plan
from kv_transfer.status import KVPoll, KVStatus


@dataclass(frozen=True)
class PairGeneration:
    """One generation of one pair feeding this decode rank (records arrive on it).

    Attributes:
        sender: ``"prefill <instance>/<rank>"``, for messages.
        generation: the pair's generation (a reconnect makes a new one).
    """

    sender: str
    generation: int


@dataclass
class TrackedRequest:
    """One expected request's transfer state; the receiver holds it only between
    :meth:`RequestTracker.admit` and the write it admits (fields are the tracker's)."""

    num_tokens: int
    deadline: float
    pairs: dict[int, PairPlan]                     # prefill rank -> what it sends us
    mask: torch.Tensor                             # bool [num_layers, num_tokens] received
    layer_tokens: tuple[int, ...] | None           # [num_layers] cells per layer (None: all)
    done_from: set[int] = field(default_factory=set)
    sources: set[PairGeneration] = field(default_factory=set)  # sent records of it
    error: str | None = None
    released: bool = False
    writers: int = 0                                 # scatters and in-place receives now
    lock: threading.Condition = field(default_factory=threading.Condition)
    forward_end: float = 0.0     # newest done record's Header.forward_end (time.time())
    cells_at: float | None = None  # time.time() when the last (layer, token) cell arrived
    cells_left: int = -1           # cells of mask still False (-1: not counted yet)
    draft_hidden: bytes = b""      # a done record's Header.draft_hidden (MTP)

    def complete(self) -> bool:
        return (self.error is None and self.done_from == set(self.pairs)
                and bool(self.mask.all()))

    def mark(self, layers: list[int], start: int, end: int) -> None:
        """Caller holds ``lock``: cells ``layers x [start, end)`` arrived (the first time the
        mask is full, its moment is kept)."""
        if self.cells_left < 0:
            self.cells_left = int((~self.mask).sum())
        new = int((~self.mask[layers, start:end]).sum())
        self.mask[layers, start:end] = True
        self.cells_left -= new
        if new and not self.cells_left:
            self.cells_at = time.time()

    def tail_s(self) -> float | None:
        """``kv_tail_s``: seconds from the end of the prefill forward of the last chunk to the
        arrival of the last cell (0 when it came first); None when a cell is missing or the
        prefill side did not say when its forward ended.
        NOTE: two clocks when prefill and decode run on different hosts."""
        if self.cells_at is None or self.forward_end <= 0.0:
            return None
        return max(0.0, self.cells_at - self.forward_end)

    def missing(self) -> str:
        parts = []
        for p, pp in sorted(self.pairs.items()):
            rows = self.mask[list(pp.layers)]  # NOTE: with CP, shared by the CP ranks
            expected = rows.numel() if self.layer_tokens is None else \
                sum(self.layer_tokens[i] for i in pp.layers)
            parts.append(f"prefill rank {p}: {int((~rows).sum())} of {expected} (layer, "
                         f"token) cells missing, done record "
                         f"{'in' if p in self.done_from else 'missing'}")
        return "; ".join(parts)


class RequestTracker:
    """Completion and write permission of one decode rank's expected requests (thread-safe)."""

    def __init__(self, layout: KVLayout, rank: int, config: TransferConfig, me: str) -> None:
        self._layout, self._rank, self._config, self._me = layout, rank, config, me
        self._requests: dict[str, TrackedRequest] = {}
        self._lock = threading.Lock()

    def expect(self, request_id: str, num_tokens: int, prefill_tp: int,
               prefill_cp: int = 1, first_token: int = 0,
               layer_tokens: Sequence[int] | None = None) -> None:
        """Start tracking; see ``DecodeKVConnector.expect`` (cells of tokens before
        ``first_token`` count as received; layer ``i`` expects tokens ``[0,
        layer_tokens[i])`` only, None: ``num_tokens`` each). Raises ValueError if known or
        out of range."""
        if min(num_tokens, prefill_tp, prefill_cp) <= 0:
            raise ValueError(f"expect({request_id!r}): num_tokens ({num_tokens}), prefill_tp "
                             f"({prefill_tp}) and prefill_cp ({prefill_cp}) must be positive")
        if not 0 <= first_token < num_tokens:
            raise ValueError(f"expect({request_id!r}): first_token ({first_token}) must be in "
                             f"[0, num_tokens={num_tokens})")
        lay = self._layout
        counts = _layer_tokens(request_id, num_tokens, lay.num_layers, layer_tokens)
        plan = build_transfer_plan(prefill_tp, lay.tp, lay.num_layers, lay.kind,
                                   lay.num_kv_heads, prefill_cp)
        pairs = {pp.prefill_rank: pp for pp in plan.recvs_to(self._rank)}
        mask = torch.zeros(lay.num_layers, num_tokens, dtype=torch.bool)
        mask[:, :first_token] = True  # NOTE: held already (prefix cache), never shipped
        for i, n in enumerate(counts or ()):
            mask[i, n:] = True  # NOTE: past the layer's own cells: never shipped
        deadline = time.monotonic() + self._config.completion_timeout_s
        req = TrackedRequest(num_tokens, deadline, pairs, mask, counts)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} is already expected on decode "
                                 f"{self._me}: release() it first")
            self._requests[request_id] = req

    def admit(self, source: PairGeneration, prefill_rank: int, chunk: KVChunk,
              num_slots: int) -> TrackedRequest | None:
        """``chunk`` arrived from ``prefill_rank`` on ``source``: the request to write into, or
        None (drop its bytes). A chunk the plan does not allow fails its request."""
        req = self._get(chunk.request_id)
        if req is None:
            return None
        with req.lock:
            req.sources.add(source)
            if not self._active(req):
                return None
            problem = _check_chunk(req, prefill_rank, chunk, num_slots)
            if problem:
                req.error = f"decode {self._me}: bad data record from {source.sender}: {problem}"
                return None
        return req

    def begin_write(self, req: TrackedRequest) -> bool:
        """Take write permission on ``req``'s slots if it is still active (then the caller
        must call :meth:`end_write`, whatever happens). While held, ``release`` waits.

        Used around a scatter (a memory copy) and around a receive straight into the cache
        (bounded by ``payload_timeout_s`` per message): the bytes land in the slots only
        while the request is expected, not failed, not past its deadline, not released.

        NOTE: the lock is not held during the write, so pairs feeding the same request
        (P16 -> D4: four per decode rank) write in parallel; ``release`` waits for
        ``writers`` to drain instead.
        """
        with req.lock:
            if not self._active(req):
                return False
            req.writers += 1
            return True

    def end_write(self, req: TrackedRequest, chunk: KVChunk, done: bool) -> None:
        """Drop the permission of :meth:`begin_write`; ``done``: mark ``chunk``'s cells."""
        with req.lock:
            req.writers -= 1
            if done:
                req.mark(list(chunk.layers), chunk.token_start, chunk.token_end)
            req.lock.notify_all()

    def on_done(self, source: PairGeneration, header: wire.Header) -> None:
        req = self._get(header.request_id)
        if req is None:
            return
        with req.lock:
            req.sources.add(source)
            if header.prefill_rank not in req.pairs:
                req.error = req.error or (f"decode {self._me}: done record from prefill rank "
                                          f"{header.prefill_rank}, which the plan does not pair "
                                          "with this rank")
            elif header.num_tokens != req.num_tokens:
                req.error = req.error or (
                    f"decode {self._me}: prefill rank {header.prefill_rank} finished "
                    f"{header.num_tokens} tokens, expected {req.num_tokens}")
            else:
                req.done_from.add(header.prefill_rank)
                req.forward_end = max(req.forward_end, header.forward_end)
                req.draft_hidden = header.draft_hidden or req.draft_hidden

    def on_abort(self, source: PairGeneration, header: wire.Header) -> None:
        self.fail(header.request_id, f"{source.sender} aborted the transfer: {header.error}")

    def fail(self, request_id: str, error: str) -> None:
        req = self._get(request_id)
        if req is not None:
            with req.lock:
                if not req.complete():
                    req.error = req.error or error

    def on_pair_lost(self, source: PairGeneration, error: str) -> None:
        """A pair generation died: fail the incomplete requests it had carried records for."""
        with self._lock:
            reqs = [(rid, r) for rid, r in self._requests.items() if source in r.sources]
        for rid, req in reqs:
            self.fail(rid, error)

    def poll(self, request_id: str) -> KVStatus:
        """The request's state (``DecodeKVConnector.poll``); applies the completion deadline.
        A request not expected (never, or released) is FAILED."""
        req = self._get(request_id)
        if req is None:
            return KVStatus(KVPoll.FAILED, f"decode {self._me}: KV of request {request_id!r} "
                            "is not expected here (never expected, or released after it "
                            "completed, failed or was aborted)")
        with req.lock:
            if self._active(req) and req.complete():
                return KVStatus(KVPoll.SUCCESS, tail_s=req.tail_s(),
                                draft_hidden=req.draft_hidden)
            if req.error is not None or req.released:
                return KVStatus(KVPoll.FAILED, req.error)
            return KVStatus(KVPoll.TRANSFERRING if req.sources else KVPoll.WAITING)

    def release(self, request_id: str) -> None:
        """Forget the request; returns once no scatter or in-place receive into its slots
        runs (none will start)."""
        with self._lock:
            req = self._requests.pop(request_id, None)
        if req is not None:
            with req.lock:
                req.released = True
                while req.writers:  # NOTE: one scatter, or one in-place receive (payload_timeout_s)
                    req.lock.wait()

    def pending(self) -> int:
        with self._lock:
            return len(self._requests)

    def _active(self, req: TrackedRequest) -> bool:
        """Caller holds ``req.lock``. Applies the deadline."""
        if req.released or req.error is not None:
            return False
        if not req.complete() and time.monotonic() > req.deadline:
            req.error = (f"decode {self._me}: KV transfer not complete after "
                         f"{self._config.completion_timeout_s:g} s (completion_timeout_s): "
                         f"{req.missing()}")
            return False
        return True

    def _get(self, request_id: str) -> TrackedRequest | None:
        with self._lock:
            return self._requests.get(request_id)


def _check_chunk(req: TrackedRequest, prefill_rank: int, c: KVChunk,
                 num_slots: int) -> str | None:
    """Why ``c`` from ``prefill_rank`` may not be written into ``req``, or None."""
    pp = req.pairs.get(prefill_rank)
    if pp is None:
        return f"prefill rank {prefill_rank} is not planned to send to this rank"
    if not set(c.layers) <= set(pp.layers):
        return f"layers {c.layers} are not all planned on this pair (plan: {pp.layers})"
    planned_heads = None if pp.heads is None else (pp.heads.start, pp.heads.stop)
    if c.heads != planned_heads:
        return f"heads {c.heads} differ from the plan's {planned_heads}"
    if c.token_end > req.num_tokens:
        return f"tokens [{c.token_start}, {c.token_end}) exceed the {req.num_tokens} expected"
    short = [] if req.layer_tokens is None else \
        [i for i in c.layers if c.token_end > req.layer_tokens[i]]
    if short:
        return (f"tokens [{c.token_start}, {c.token_end}) of layer {short[0]} exceed its "
                f"{req.layer_tokens[short[0]]} expected")
    slots = c.dst_slots
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        return f"destination slots outside [0, {num_slots})"
    return None


def _layer_tokens(request_id: str, num_tokens: int, num_layers: int,
                  layer_tokens: Sequence[int] | None) -> tuple[int, ...] | None:
    """``layer_tokens`` checked (one per layer, each in ``[0, num_tokens]``); None stays None
    (``num_tokens`` for every layer).

    Raises:
        ValueError: a count out of range, or not one per layer."""
    if layer_tokens is None:
        return None
    counts = tuple(int(n) for n in layer_tokens)
    if len(counts) != num_layers or not all(0 <= n <= num_tokens for n in counts):
        raise ValueError(f"expect({request_id!r}): layer_tokens {counts} must give each of the "
                         f"{num_layers} layers a count in [0, num_tokens={num_tokens}]")
    return counts

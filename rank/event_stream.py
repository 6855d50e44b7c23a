"""The leader's token path to the router: one TCP stream per router, no Ray call per step.

The loop thread gathers the step's token events (:meth:`EventStream.add`)
and, once per loop iteration, closes them into one frame (:meth:`EventStream.flush`) that also
carries the leader's free KV blocks and, on DeepSeek-V4, its KV group pools' uncommitted blocks
(the router's admission queue wakes on them). A sender thread
per connected router writes the frames; the loop thread only appends to a list, so a slow or gone
router never stalls a step.

Wire: frames are an 8-byte big-endian length and a msgpack body. A router opens a stream with
the hello ``[token, subscriber, resume_seq]`` (``token`` from :meth:`EventStream.open`, over Ray);
the leader answers ``[epoch, first_seq]`` and then sends frames ``[seq, free_blocks, events,
ranks_age_s, status, group_free]``, ``events`` a list of :func:`event_row` rows, ``ranks_age_s``
the seconds since every rank of the instance was last known alive (None: not known), ``status``
a rank/status_row.py row or None, ``group_free`` a map KV group -> uncommitted blocks
(DeepSeek-V4's group pools) or None; seq counts from 0 per subscriber without gaps.

Reports (the router's health monitor and status board read them instead of calling the ranks
over Ray): a subscriber that asks for a heartbeat (``beat_s``) gets a frame at least every
``beat_s`` seconds while the loop runs, events or not; a status set with :meth:`EventStream.set_status`
rides the next frame. A router whose connection breaks connects again with
``resume_seq`` = the seq after the last frame it applied, and gets every later frame exactly once.

Bounds (NOTE: what happens when a router falls behind):
- at most :data:`MAX_UNSENT` frames wait unsent per subscriber; beyond that each flush merges its
  events into the newest unsent frame (coalesced: every token still arrives, in order, in fewer
  frames), so a stalled router costs memory in tokens, never a step;
- the last :data:`RETAIN` sent frames are kept for a resume; a resume from before them is
  answered ``[epoch, -1]`` (gap) and the router treats the instance as failed.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgpack

from engine.kv_events import KVCacheEvents
from engine.sampling_params import TokenLogprobs
from rank.messages import TokenEvent
from rank.sockets import accept_each, recv_exact, shut
from rank.status_row import merge_rows

log = logging.getLogger(__name__)

_LEN = struct.Struct("!Q")
MAX_UNSENT = 256  # frames waiting per subscriber before flushes coalesce
RETAIN = 4096  # sent frames kept per subscriber for a resume
HELLO_TIMEOUT_S = 5.0  # a connection says its hello within this, else it is closed
SEND_TIMEOUT_S = 30.0  # one frame's send; past it the connection is dropped (router may resume)
MAX_FRAME_BYTES = 1 << 30


def pack_frame(body: object) -> bytes:
    """Length-prefixed msgpack of ``body``."""
    data = msgpack.packb(body, use_bin_type=True)
    return _LEN.pack(len(data)) + data


def event_row(event: TokenEvent) -> list:
    """``event`` as it travels: [request_id, token_ids, finish_reason, error, retryable,
    num_cached_tokens, logprobs, kv_events, ttft_phases] (logprobs
    ``[[token_id, logprob, [[id, lp]..]]..]``; kv_events ``[block_size, salt, stored, removed,
    reset, hits, queried]`` or None; ttft_phases ``[[phase, seconds]..]``)."""
    kv = event.kv_events
    return [event.request_id, list(event.token_ids), event.finish_reason, event.error,
            event.retryable, event.num_cached_tokens,
            [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in event.logprobs],
            None if kv is None else [kv.block_size, kv.salt, list(kv.stored), list(kv.removed),
                                     kv.reset, kv.hits_tokens, kv.queried_tokens],
            [list(p) for p in event.ttft_phases]]


def event_from_row(row: list, source: str, instance: str) -> TokenEvent:
    """:func:`event_row`'s inverse, for events of ``instance`` (role ``source``)."""
    rid, tokens, finish, error, retryable, cached, logprobs, kv, phases = row
    return TokenEvent(
        rid, tuple(tokens), finish, error, source, instance, retryable,
        num_cached_tokens=cached,
        logprobs=tuple(TokenLogprobs(t, lp, tuple((a, b) for a, b in top))
                       for t, lp, top in logprobs),
        kv_events=None if kv is None else KVCacheEvents(
            kv[0], kv[1], tuple(kv[2]), tuple(kv[3]), kv[4], kv[5], kv[6]),
        ttft_phases=tuple((p, s) for p, s in phases))


@dataclass
class _Outbox:
    """One subscriber's frames: ``frames[i]`` has seq ``first_seq + i``; those from ``cursor``
    on are unsent on the current connection. Guarded by the stream's condition."""

    first_seq: int = 0
    frames: deque = field(default_factory=deque)  # [seq, free, rows, age, status, groups]
    sent: int = 0  # frames[:sent] went out on some connection
    conn: socket.socket | None = None
    cursor: int = 0  # next seq the current connection sends

    @property
    def next_seq(self) -> int:
        return self.first_seq + len(self.frames)


class EventStream:
    """Leader end of the token path (see the module docstring).

    Args:
        name: the instance's name (thread names, logs).
        host: the address to listen on (the instance's ``bind_host``).
    """

    def __init__(self, name: str, host: str) -> None:
        self.name, self.host = name, host
        self.token = secrets.token_bytes(16)
        self.epoch = secrets.token_hex(8)  # this leader's life: a resume needs the same one
        self._cond = threading.Condition()
        self._outboxes: dict[str, _Outbox] = {}
        self._pending: list[list] = []  # rows added since the last flush
        self._last_free: tuple | None = None  # (free_blocks, group_free) last sent
        self._beat_s: float | None = None  # the shortest heartbeat a subscriber asked for
        self._last_frame_at = 0.0  # time.monotonic() of the last frame made
        self._status: list | None = None  # a status row for the next frame
        self._listener: socket.socket | None = None
        self._closed = False

    # ---- bring-up (Ray control plane) -------------------------------------------------
    def open(self, subscriber: str, beat_s: float | None = None) -> tuple[str, int, bytes, str]:
        """Listen (first call), create ``subscriber``'s outbox; (host, port, token, epoch).
        ``beat_s``: a frame at least this often (seconds), for every subscriber."""
        with self._cond:
            if beat_s is not None:
                self._beat_s = min(beat_s, self._beat_s or beat_s)
            if self._closed:
                raise RuntimeError(f"{self.name}: the event stream is closed")
            if self._listener is None:
                self._listener = socket.create_server((self.host, 0), backlog=64)
                threading.Thread(target=self._accept_loop, args=(self._listener,),
                                 name=f"{self.name}-events", daemon=True).start()
            self._outboxes.setdefault(subscriber, _Outbox())
            self._last_free = None  # NOTE: the next flush reports capacity to it
            port = self._listener.getsockname()[1]
        return self.host, port, self.token, self.epoch

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def subscribed(self) -> bool:
        """Whether any router opened a stream (events then go here, not to ``poll``)."""
        return bool(self._outboxes)

    # ---- loop thread ------------------------------------------------------------------
    def add(self, event: TokenEvent) -> None:
        """Queue ``event`` for the next frame (any thread; never blocks on the network)."""
        row = event_row(event)
        with self._cond:
            self._pending.append(row)

    def set_status(self, row: list) -> None:
        """Send status ``row`` (rank/status_row.py) with the next frame (any thread)."""
        with self._cond:
            self._status = merge_rows(self._status, row)  # NOTE: one not sent yet keeps its records

    def beat_due_in(self) -> float | None:
        """Seconds until a heartbeat frame is due (<= 0: now), None when no subscriber asked
        for one."""
        with self._cond:
            if self._beat_s is None or not self._outboxes:
                return None
            return self._last_frame_at + self._beat_s - time.monotonic()

    def flush(self, free_blocks: int, ranks_age_s: float | None = None,
              group_free: dict[str, int] | None = None) -> bool:
        """Close the queued events into one frame per subscriber, with ``free_blocks``,
        ``ranks_age_s`` and ``group_free`` (see the module docstring); also when only
        ``free_blocks`` or ``group_free`` changed, a status waits, or a heartbeat is due. True
        when a frame was made."""
        now = time.monotonic()
        room = (free_blocks, group_free)
        with self._cond:
            beat = self._beat_s is not None and now - self._last_frame_at >= self._beat_s
            if not self._outboxes or (not self._pending and room == self._last_free
                                      and self._status is None and not beat):
                return False
            rows, self._pending = self._pending, []
            status, self._status = self._status, None
            self._last_free, self._last_frame_at = room, now
            for box in self._outboxes.values():
                self._append(box, [free_blocks, rows, ranks_age_s, status, group_free])
            self._cond.notify_all()
        return True

    def _append(self, box: _Outbox, body: list) -> None:
        """``body`` ([free_blocks, rows, ranks_age_s, status, group_free]) as ``box``'s next
        frame."""
        if len(box.frames) - box.sent >= MAX_UNSENT:
            last = box.frames[-1]  # NOTE: unsent, so no connection saw it: safe to grow
            last[1], last[3], last[4] = body[0], body[2], merge_rows(last[4], body[3])
            last[5] = body[4]
            last[2].extend(body[1])
            return
        # NOTE: its own list of rows: it may grow
        box.frames.append([box.next_seq, body[0], list(body[1]), body[2], body[3], body[4]])
        while box.sent > RETAIN:
            box.frames.popleft()
            box.first_seq += 1
            box.sent -= 1

    # ---- connections ------------------------------------------------------------------
    def _accept_loop(self, listener: socket.socket) -> None:
        accept_each(self.name, listener, lambda: self._closed, lambda conn: threading.Thread(
            target=self._serve, args=(conn,), daemon=True,
            name=f"{self.name}-events-out").start())

    def _serve(self, conn: socket.socket) -> None:
        """One router connection: hello, then frames until it breaks or the stream closes."""
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello_by = time.monotonic() + HELLO_TIMEOUT_S  # NOTE: the whole hello, not per recv
            (size,) = _LEN.unpack(recv_exact(conn, _LEN.size, hello_by))
            if size > 4096:
                raise ConnectionError("hello too long")
            token, subscriber, resume = msgpack.unpackb(recv_exact(conn, size, hello_by),
                                                        raw=False)
            if not hmac.compare_digest(bytes(token), self.token):
                raise ConnectionError("wrong token")
            box = self._attach(conn, subscriber, int(resume))
            if box is None:
                return
            conn.settimeout(SEND_TIMEOUT_S)
            self._send_loop(conn, box)
        except (OSError, ValueError, TypeError, msgpack.UnpackException) as exc:
            log.debug("%s: an event connection ended: %s", self.name, exc)
        finally:
            self._detach(conn)
            conn.close()

    def _attach(self, conn: socket.socket, subscriber: str, resume: int) -> _Outbox | None:
        """Make ``conn`` the subscriber's connection from seq ``resume``; None (after telling
        the router) when that seq is no longer kept."""
        with self._cond:
            box = self._outboxes.get(subscriber)
            if box is None or resume < box.first_seq or resume > box.next_seq:
                conn.sendall(pack_frame([self.epoch, -1]))
                return None
            old, box.conn, box.cursor = box.conn, conn, resume
            self._cond.notify_all()
        if old is not None:
            shut(old)
        conn.sendall(pack_frame([self.epoch, resume]))
        return box

    def _send_loop(self, conn: socket.socket, box: _Outbox) -> None:
        while True:
            with self._cond:
                while box.conn is conn and box.cursor >= box.next_seq and not self._closed:
                    self._cond.wait()
                if box.conn is not conn or self._closed:
                    return
                start = box.cursor - box.first_seq
                batch = [box.frames[i] for i in range(max(start, 0), len(box.frames))]
                box.cursor = box.next_seq
                box.sent = max(box.sent, len(box.frames))
                data = b"".join(pack_frame(frame) for frame in batch)
            conn.sendall(data)

    def _detach(self, conn: socket.socket) -> None:
        with self._cond:
            for box in self._outboxes.values():
                if box.conn is conn:
                    box.conn = None

    def break_connections(self) -> None:
        """Close every router connection now (they may resume); tests and shutdown."""
        with self._cond:
            conns = [box.conn for box in self._outboxes.values() if box.conn is not None]
        for conn in conns:
            shut(conn)

    def close(self) -> None:
        """Stop listening and close every connection; later :meth:`open` calls raise."""
        with self._cond:
            self._closed = True
            listener, self._listener = self._listener, None
            self._cond.notify_all()
        if listener is not None:
            shut(listener)
            listener.close()
        self.break_connections()

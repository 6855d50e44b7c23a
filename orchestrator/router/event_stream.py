"""Router end of one leader's token stream (rank/event_stream.py has the wire and the leader end).

:meth:`EventSubscription.frames` asks the leader for its stream's address over Ray (the control
plane), connects, and yields one :class:`EventFrame` per leader flush, in seq order, each once.
A connection that breaks is opened again with the seq after the last frame applied (resume), a
few times in a row; when that fails, or the leader lost the frames (a restarted leader, a resume
older than it keeps), :class:`StreamBroken` says the instance's events are lost: the caller fails
the requests watching it and subscribes again (the next call to :meth:`~EventSubscription.frames`).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgpack

from rank.event_stream import event_from_row
from rank.messages import InstanceStatusInfo, TokenEvent
from rank.status_row import status_from_row

_LEN = struct.Struct("!Q")
CONNECT_TIMEOUT_S = 5.0  # connect + hello answer
RECONNECTS = 3  # tries to resume a broken connection before the instance counts as failed
RECONNECT_PAUSE_S = 0.05
# (host, port, token, epoch) of a leader's stream for one subscriber (``Rank.open_events``).
StreamAddress = tuple[str, int, bytes, str]


class StreamBroken(RuntimeError):
    """The leader's events could not be followed (gone, refused, or frames lost)."""


@dataclass(frozen=True)
class EventFrame:
    """One leader flush: ``seq`` (per subscriber, from 0, no gaps), the leader's free KV
    blocks then, and the events of the flush in emission order; ``ranks_age_s``: seconds
    since every rank of the instance was last known alive when the leader made the frame
    (None: not known, or a leader that does not say); ``status``: the leader's status report,
    if one rode this frame (rank/status_report.py); ``group_free``: DeepSeek-V4's KV group ->
    blocks a new request may still commit there (None: not V4, or a leader that does not
    say)."""

    seq: int
    free_blocks: int
    events: tuple[TokenEvent, ...]
    ranks_age_s: float | None = None
    status: InstanceStatusInfo | None = None
    group_free: dict[str, int] | None = None


class EventSubscription:
    """Follows one leader's events for one router.

    Args:
        name: instance name; source: its events' ``TokenEvent.source``.
        subscriber: this router's id (the leader keeps one outbox per id).
        open_events: ``async (subscriber) -> StreamAddress``, the Ray call (raises on failure;
            it may ask the leader for heartbeats and status reports, rank/event_stream.py).
        keep: ``(row) -> bool`` on each event row (rank/event_stream.py ``event_row``): rows it
            refuses are skipped before they are decoded (router replicas: every replica gets
            every event and keeps its own requests'). None: keep all.
    """

    def __init__(self, name: str, source: str, subscriber: str,
                 open_events: Callable[[str], Awaitable[StreamAddress]],
                 keep: Callable[[list], bool] | None = None) -> None:
        self.name, self.source, self.subscriber = name, source, subscriber
        self._open_events = open_events
        self._keep = keep
        self._epoch: str | None = None
        self.next_seq = 0  # the seq of the next frame to apply

    async def frames(self) -> AsyncIterator[EventFrame]:
        """Frames until cancelled.

        Raises:
            StreamBroken: the stream could not be opened or resumed (see the module docstring).
        """
        try:
            host, port, token, epoch = await self._open_events(self.subscriber)
        except Exception as exc:  # noqa: BLE001 - the Ray call's failure is the instance's
            raise StreamBroken(f"{self.name}: opening its event stream failed: {exc}") from exc
        if epoch != self._epoch:  # a new leader: its frames count from 0
            self._epoch, self.next_seq = epoch, 0
        tries = 0
        while True:
            try:
                async for frame in self._connection(host, port, bytes(token)):
                    tries = 0
                    yield frame
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                tries += 1
                if tries > RECONNECTS:
                    raise StreamBroken(f"{self.name}: its event stream broke and could not be "
                                       f"resumed ({type(exc).__name__}: {exc})") from exc
                await asyncio.sleep(RECONNECT_PAUSE_S)

    async def _connection(self, host: str, port: int, token: bytes) -> AsyncIterator[EventFrame]:
        """One connection, resumed at :attr:`next_seq`."""
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                                CONNECT_TIMEOUT_S)
        try:
            hello = msgpack.packb([token, self.subscriber, self.next_seq], use_bin_type=True)
            writer.write(_LEN.pack(len(hello)) + hello)
            epoch, first = await asyncio.wait_for(_read(reader), CONNECT_TIMEOUT_S)
            if epoch != self._epoch or first != self.next_seq:
                raise StreamBroken(f"{self.name}: its event stream lost frames (resume at "
                                   f"{self.next_seq} refused)")
            while True:
                seq, free_blocks, rows, *report = await _read(reader)
                if seq != self.next_seq:
                    raise StreamBroken(f"{self.name}: event frame {seq} came, "
                                       f"{self.next_seq} expected")
                self.next_seq = seq + 1
                keep = self._keep
                # NOTE: a leader that sends none of them
                age, status, groups = (report + [None, None, None])[:3]
                yield EventFrame(seq, free_blocks, tuple(
                    event_from_row(row, self.source, self.name) for row in rows
                    if keep is None or keep(row)), age,
                    None if status is None else status_from_row(status), groups)
        finally:
            writer.close()


async def _read(reader: asyncio.StreamReader) -> list:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    return msgpack.unpackb(await reader.readexactly(size), raw=False)

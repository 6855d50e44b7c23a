"""When one layer's KV may be read by a sender: the order between the forward that writes a
layer and the copies that send it, per device kind.

On CPU the forward's write is finished when its hook runs (ops are synchronous): nothing to
order, :func:`mark_written` gives None. On a device (cuda, npu) the write is only enqueued on
the compute stream: :func:`mark_written` records an event there, right after the write, and
each sender thread runs a record's copies (gather into staging buffers, collective sends of
cache views) on its own :class:`CopyStream`, which waits for that event first. The compute
stream never waits for a copy, and a copy never runs before its layer's write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def mark_written(device: torch.device) -> object | None:
    """An event recorded on ``device``'s current stream (call right after a layer's KV
    write, on the thread that wrote it); None on CPU (the write is already done)."""
    if device.type == "cpu":
        return None
    event = torch.get_device_module(device.type).Event()
    event.record()
    return event


class CopyStream:
    """One sender thread's own stream on ``device`` (none on CPU).

    NOTE: made on the sender thread's first record; the thread's copies and collective sends
    are enqueued on it (``with stream.after(event): ...``), never on the compute stream.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._module = None if device.type == "cpu" else torch.get_device_module(device.type)
        self._stream = None

    @contextlib.contextmanager
    def after(self, written: object | None) -> Iterator[None]:
        """Run the body's device work on this stream, ordered after ``written`` (an event
        of :func:`mark_written`; None: no order needed, the body runs as it would)."""
        if written is None or self._module is None:
            yield
            return
        if self._stream is None:
            self._stream = self._module.Stream(device=self._device)
        self._stream.wait_event(written)
        with self._module.stream(self._stream):
            yield

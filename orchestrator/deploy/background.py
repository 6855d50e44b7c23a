"""Fire-and-forget calls on the event loop that are kept referenced and whose failure is logged.

asyncio holds only a weak reference to a task, so a call nobody awaits must be kept somewhere
until it ends; and a failure nobody awaits is otherwise reported only as "exception never
retrieved" at garbage collection. The replicas' health pushes and the mirrored failure reports
are such calls.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable

log = logging.getLogger(__name__)


class Background:
    """The calls started by :meth:`start` that have not ended yet.

    ``what`` names them in the warning logged when one fails (e.g. "a failure report").
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._pending: set[asyncio.Future] = set()

    def start(self, call: Awaitable) -> asyncio.Future:
        """Run ``call`` on the running loop without awaiting it; returns its future."""
        future = asyncio.ensure_future(call)
        self._pending.add(future)
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future: asyncio.Future) -> None:
        self._pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            log.warning("%s failed: %s", self.what, future.exception())

    async def wait(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s`` seconds, for the calls still pending to end."""
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=timeout_s)

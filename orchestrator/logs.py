"""orch's own log: stderr, ``$ORCH_LOG_LEVEL`` (INFO), one line per event.

Faults are logged as one concise line each (what failed, the worker's own error), with their
detail (tracebacks) at DEBUG. A warning that repeats word for word (a loop retrying a dead
instance every half second) is shown once per :data:`REPEAT_WINDOW_S`, with the count of the
repeats left out (:class:`RepeatFilter`); at DEBUG every line is shown. Off a terminal the
lines carry no ANSI colour codes, wherever the text came from (Ray colours parts of its error
messages).
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from typing import Callable

from engine import envs  # standard library only

ANSI_CODE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REPEAT_WINDOW_S = 60.0
MAX_REMEMBERED = 1000  # distinct warnings remembered at once (bounded memory)
# NOTE: libraries that log one INFO line per HTTP request (`orch bench --backend openai`
# would print one per replayed request); shown at DEBUG only.
PER_REQUEST_LOGGERS = ("httpx", "httpcore")


class PlainFormatter(logging.Formatter):
    """The standard formatter with ANSI colour codes removed from the finished line."""

    def format(self, record: logging.LogRecord) -> str:
        return ANSI_CODE.sub("", super().format(record))


# NOTE: a health transition or a refused restart is an event, however alike its text (the
# same instance killed twice); the restart rate already bounds how often these log.
NEVER_FOLDED = frozenset({"orchestrator.deploy.health", "orchestrator.deploy.recovery"})


class RepeatFilter(logging.Filter):
    """Drops a WARNING-or-worse line identical (logger and text) to one shown less than
    ``window_s`` seconds ago; the next one shown says how many were dropped.

    Args:
        window_s: seconds during which an identical line is dropped.
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(self, window_s: float = REPEAT_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s, self.clock = window_s, clock
        self._shown: dict[tuple[str, str], tuple[float, int]] = {}  # -> (shown at, dropped)
        self._lock = threading.Lock()  # NOTE: handlers call filters outside their own lock

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or record.name in NEVER_FOLDED:
            return True
        key, now = (record.name, record.getMessage()), self.clock()
        with self._lock:
            shown_at, dropped = self._shown.get(key, (None, 0))
            if shown_at is not None and now - shown_at < self.window_s:
                self._shown[key] = (shown_at, dropped + 1)
                return False
            if len(self._shown) >= MAX_REMEMBERED:
                self._forget_before(now - self.window_s)
            self._shown[key] = (now, 0)
        if dropped:
            record.msg, record.args = (f"{key[1]} (and {dropped} identical line(s) in the "
                                       f"{self.window_s:g} s before)"), ()
        return True

    def _forget_before(self, cutoff: float) -> None:
        stale = [key for key, (shown_at, _) in self._shown.items() if shown_at < cutoff]
        for key in stale or list(self._shown)[:MAX_REMEMBERED // 2]:
            del self._shown[key]


def setup_logging() -> None:
    """Configure the root logger once for an `orch` command (see the module docstring).

    An invalid ``$ORCH_LOG_LEVEL`` is reported on stderr and INFO is used. gRPC's C core
    prints only errors (``GRPC_VERBOSITY``; must be set before gRPC is first imported); the
    HTTP client's per-request lines (:data:`PER_REQUEST_LOGGERS`) show at DEBUG only.
    """
    envs.GRPC_VERBOSITY.set_default("ERROR")
    try:
        level = envs.ORCH_LOG_LEVEL.get()
    except ValueError as exc:
        print(f"orch: {exc}; using INFO", file=sys.stderr)
        level = "INFO"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT) if sys.stderr.isatty()
                         else PlainFormatter(FORMAT))
    if level != "DEBUG":
        handler.addFilter(RepeatFilter())
        for name in PER_REQUEST_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    logging.basicConfig(level=level, handlers=[handler])

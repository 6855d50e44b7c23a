"""Stop strings over a request's streamed text, trimmed like OpenAI: the stop string and
everything after it are never sent (the router applies them to gRPC and HTTP requests alike).

Text that could still be the start of a stop string is held back (at most the longest stop
string's length minus one characters) until the next piece shows it is not.
"""

from __future__ import annotations

MAX_STOP_STRINGS = 16


class StopText:
    """Finds the first of ``stops`` (non-empty strings) in a stream of text pieces."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""  # text received but not yet returned

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a piece; returns (text safe to send now, True when a stop string was found:
        the text ends just before it and nothing more may be sent)."""
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[:min(hits)], True
        cut = max(len(buf) - self._hold, 0)
        self._pending = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        """The held-back text (the stream ended without a stop string)."""
        out, self._pending = self._pending, ""
        return out

"""A request's streamed text: incremental detokenization, then its stop strings."""

from __future__ import annotations

from orchestrator.router.detokenizer import IncrementalDetokenizer, Tokenizer
from orchestrator.router.stop_text import StopText


class OutputText:
    """One per request (every attempt of it: a migrated stream's text goes on).

    Without a tokenizer there is no text (stop strings are refused by validation then).
    """

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer else None
        self.stop = StopText(stops)

    def add(self, token_ids: tuple[int, ...]) -> tuple[str, bool]:
        """Text of new tokens safe to send now, and whether a stop string was found (the
        text ends just before it; nothing more may be sent)."""
        return self.stop.feed(self.detok.add(token_ids) if self.detok else "")

    def finish(self) -> tuple[str, bool]:
        """The rest of the text when the request ends (held-back bytes and characters), and
        whether a stop string was found in it."""
        text, stopped = self.stop.feed(self.detok.flush() if self.detok else "")
        return (text, True) if stopped else (text + self.stop.flush(), False)

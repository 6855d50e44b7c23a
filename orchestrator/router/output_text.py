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

    def add_until_stop(self, token_ids: tuple[int, ...]) -> tuple[str, bool, int]:
        """:meth:`add` one token at a time when a stop string may end the request inside
        ``token_ids`` (several tokens in one event: MTP's accepted drafts, or events merged
        behind a slow consumer); returns (text, stopped, how many of ``token_ids`` were
        taken: all, or up to and including the one that completed the stop string), so the
        ids sent end where one token per event would have ended them."""
        if len(token_ids) <= 1 or not self.stop.stops:
            return *self.add(token_ids), len(token_ids)
        text = ""
        for taken, token_id in enumerate(token_ids, start=1):
            piece, stopped = self.add((token_id,))
            text += piece
            if stopped:
                return text, True, taken
        return text, False, len(token_ids)

    def finish(self) -> tuple[str, bool]:
        """The rest of the text when the request ends (held-back bytes and characters), and
        whether a stop string was found in it."""
        text, stopped = self.stop.feed(self.detok.flush() if self.detok else "")
        return (text, True) if stopped else (text + self.stop.flush(), False)

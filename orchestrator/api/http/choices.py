"""One choice of a response: its text pieces turned into OpenAI's choice objects, whole or as
streamed chunks, with logprobs in each endpoint's format and (chat) the DeepSeek output parsed
into ``reasoning_content`` / ``content`` / ``tool_calls``
(:mod:`orchestrator.api.http.deepseek_output`).

Logprob formats: chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``;
completions ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.sampling_params import TokenLogprobs
from orchestrator.api.http.deepseek_output import OutputStream
from orchestrator.api.http.generation import Piece

TokenText = Callable[[int], str]


class Choice:
    """The state of choice ``index``.

    Args:
        index: its place in ``choices``.
        chat: chat completions (else completions).
        token_text: token id -> its text (logprob entries).
        parser: the chat output parser, or None (completions).
    """

    def __init__(self, index: int, chat: bool, token_text: TokenText,
                 parser: OutputStream | None) -> None:
        self.index, self.chat, self.token_text, self.parser = index, chat, token_text, parser
        self.text: list[str] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish: str | None = None
        self._first = True
        self._offset = 0

    def chunks(self, piece: Piece, want_logprobs: bool) -> list[dict[str, Any]]:
        """The streamed choice objects ``piece`` makes (at least one when it ends the choice
        or carries logprobs)."""
        self.text.append(piece.text)
        final = piece.finish_reason is not None
        logprobs = self._logprobs(piece.logprobs) if want_logprobs else None
        if self.chat:
            deltas = self.parser.feed(piece.text, final) if self.parser else \
                ([{"content": piece.text}] if piece.text else [])
        else:
            deltas = [{"text": piece.text}] if piece.text else []
        if not deltas and (final or logprobs):
            deltas = [{"content": ""} if self.chat else {"text": ""}]
        out = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            out.append(self._choice(delta, logprobs if i == 0 else None,
                                    self._finish(piece.finish_reason) if last else None))
        return out

    def _choice(self, delta: dict[str, Any], logprobs: Any, finish: str | None
                ) -> dict[str, Any]:
        if not self.chat:
            return {"index": self.index, "text": delta["text"], "logprobs": logprobs,
                    "finish_reason": finish}
        if self._first:
            delta, self._first = {"role": "assistant", **delta}, False
        return {"index": self.index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish}

    def _finish(self, finish: str | None) -> str | None:
        if finish == "stop" and self.parser is not None and self.parser.has_calls:
            return "tool_calls"
        return finish

    def add(self, piece: Piece) -> None:
        """Collect ``piece`` for :meth:`whole`."""
        self.text.append(piece.text)
        self.logprobs.extend(piece.logprobs)
        if piece.finish_reason is not None:
            self.finish = piece.finish_reason

    def whole(self, want_logprobs: bool) -> dict[str, Any]:
        """The non-streamed choice object."""
        text = "".join(self.text)
        logprobs = self._logprobs(tuple(self.logprobs)) if want_logprobs else None
        if not self.chat:
            return {"index": self.index, "text": text, "logprobs": logprobs,
                    "finish_reason": self.finish}
        if self.parser is None:
            message = {"role": "assistant", "content": text}
            finish = self.finish
        else:
            self.parser.feed(text, final=True)
            message = self.parser.message()
            finish = "tool_calls" if self.finish == "stop" and "tool_calls" in message \
                else self.finish
        return {"index": self.index, "message": message, "logprobs": logprobs,
                "finish_reason": finish}

    def _logprobs(self, entries: tuple[TokenLogprobs, ...]) -> dict[str, Any] | None:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for tok in tokens:
            offsets.append(self._offset)
            self._offset += len(tok)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): v for t, v in e.top} for e in entries],
                "text_offset": offsets}

    def _chat_entry(self, e: TokenLogprobs) -> dict[str, Any]:
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
        return {**one(e.token_id, e.logprob),
                "top_logprobs": [one(t, v) for t, v in e.top]}

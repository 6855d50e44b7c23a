"""Response bodies of the two generation endpoints: one shape object per endpoint, so the
request handling is written once (``orchestrator.api.http.generation``).

Streamed chunks carry the new text; the chunk with ``finish_reason`` ends the choice; with
``stream_options.include_usage`` a last chunk has no choices and the ``usage``. Not streamed:
one body with the whole text and the usage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.api.http.openai_schema import usage


@dataclass(frozen=True)
class Shape:
    """How one endpoint names things.

    Attributes:
        id_prefix: of the response id ("cmpl-", "chatcmpl-").
        object: the non-streamed body's ``object``.
        chunk_object: each streamed chunk's ``object``.
        chat: choices carry ``message`` / ``delta`` (chat) instead of ``text``.
    """

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool

    def chunk(self, rid: str, created: int, model: str, text: str, finish: str | None,
              first: bool) -> dict[str, Any]:
        """One streamed chunk (the first chat chunk also names the role)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first \
                else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._body(rid, created, model, [choice], streamed=True)

    def usage_chunk(self, rid: str, created: int, model: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The last streamed chunk with ``stream_options.include_usage``."""
        body = self._body(rid, created, model, [], streamed=True)
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def whole(self, rid: str, created: int, model: str, text: str, finish: str | None,
              prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0) -> dict[str, Any]:
        """The non-streamed body."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = self._body(rid, created, model, [choice], streamed=False)
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def _body(self, rid: str, created: int, model: str, choices: list,
              streamed: bool) -> dict[str, Any]:
        return {"id": self.id_prefix + rid, "object": self.chunk_object if streamed
                else self.object, "created": created, "model": model, "choices": choices}


COMPLETION = Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)

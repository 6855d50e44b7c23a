"""Response bodies of the two generation endpoints: one shape object per endpoint, so the
request handling is written once (``orchestrator.api.http.app``).

Streamed chunks carry one choice's delta (``index`` says which); the chunk with
``finish_reason`` ends that choice; with ``stream_options.include_usage`` a last chunk has no
choices and the ``usage``. Not streamed: one body with every choice and the usage (the prompt
counted once, the completion tokens of every choice summed).
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

    def chunk(self, rid: str, created: int, model: str,
              choice: dict[str, Any]) -> dict[str, Any]:
        """One streamed chunk of one choice (see :mod:`orchestrator.api.http.choices`)."""
        return self._body(rid, created, model, [choice], streamed=True)

    def usage_chunk(self, rid: str, created: int, model: str, prompt_tokens: int,
                    completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        """The last streamed chunk with ``stream_options.include_usage``."""
        body = self._body(rid, created, model, [], streamed=True)
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def whole(self, rid: str, created: int, model: str, choices: list[dict[str, Any]],
              prompt_tokens: int, completion_tokens: int,
              cached_tokens: int = 0) -> dict[str, Any]:
        """The non-streamed body."""
        body = self._body(rid, created, model, choices, streamed=False)
        body["usage"] = usage(prompt_tokens, completion_tokens, cached_tokens)
        return body

    def _body(self, rid: str, created: int, model: str, choices: list,
              streamed: bool) -> dict[str, Any]:
        return {"id": self.id_prefix + rid, "object": self.chunk_object if streamed
                else self.object, "created": created, "model": model, "choices": choices}


COMPLETION = Shape("cmpl-", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl-", "chat.completion", "chat.completion.chunk", chat=True)

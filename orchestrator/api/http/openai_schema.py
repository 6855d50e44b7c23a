"""OpenAI request bodies (pydantic) and response bodies (plain dicts), as the official client
sends and reads them.

Supported: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``, ``top_p``,
``seed``, ``stop`` (strings), ``stream`` with ``stream_options.include_usage``, ``n`` = 1, and
two vLLM extensions the bench uses: ``top_k`` and ``ignore_eos``. A completion prompt is one
string or one list of token ids. Unknown fields are ignored (as OpenAI-compatible servers do);
known ones orch cannot honour (``n`` > 1, ``logprobs``, ``echo``, penalties, ``logit_bias``,
several prompts) are refused with a 400 saying so. Types are strict, as OpenAI's are (``"stream":
"yes"`` or ``"max_tokens": true`` is a 400, an integer where a number goes is fine), and every
optional field may be ``null`` (its default), as OpenAI's schema allows and many clients send.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.router.request import RequestError

MAX_STOP_STRINGS = 16


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None


class GenerationRequest(BaseModel):
    """Fields both endpoints share. None means "the OpenAI default"."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None  # OpenAI's default: 1
    top_k: int | None = None  # 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None  # 1
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def stop_strings(self) -> tuple[str, ...]:
        """The non-empty stop strings (at most MAX_STOP_STRINGS)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError("INVALID_ARGUMENT", f"stop has {len(stops)} strings; at most "
                                                   f"{MAX_STOP_STRINGS} are allowed")
        return tuple(s for s in stops if s)

    def check_supported(self) -> None:
        """Refuse what orch cannot do (INVALID_ARGUMENT naming it)."""
        if self.n not in (None, 1):
            raise RequestError("INVALID_ARGUMENT", f"n={self.n} is not supported: orch returns "
                                                   "one choice per request; send n=1 (or omit "
                                                   "it) and repeat the request for more")
        for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
            if getattr(self, name):
                raise RequestError("INVALID_ARGUMENT", f"{name} is not supported by orch: "
                                                       "omit it (or send 0)")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise RequestError("INVALID_ARGUMENT", "logprobs is not supported by orch: omit it")
        if self.echo:
            raise RequestError("INVALID_ARGUMENT", "echo is not supported by orch: omit it")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) \
                and len(self.prompt) != 1:
            raise RequestError("INVALID_ARGUMENT", f"prompt is a list of {len(self.prompt)} "
                                                   "strings: send one prompt per request")

    def prompt_parts(self) -> tuple[str | None, tuple[int, ...] | None]:
        """(text, None) or (None, token ids)."""
        if isinstance(self.prompt, str):
            return self.prompt, None
        if self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0]), None
        return None, tuple(int(t) for t in self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message; fields beyond role/content (name, tool_calls, ...) reach the template."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the template reads it: content as one string, or None (kept: an
        assistant turn with ``tool_calls`` has ``content: null``, which templates test for)."""
        out = self.model_dump(exclude_none=True)
        out["content"] = "".join(part.text for part in self.content) \
            if isinstance(self.content, list) else self.content
        return out


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise RequestError("INVALID_ARGUMENT", "logprobs is not supported by orch: omit "
                                                   "logprobs and top_logprobs")

    @property
    def token_budget(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (fill the context)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


def validation_message(exc: ValidationError) -> str:
    """A pydantic error as one line naming each bad field."""
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "invalid request body: " + "; ".join(parts)


def error_body(message: str, kind: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens found in the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def model_list(model: str, created: int) -> dict[str, Any]:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "orch"}]}


def now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())

"""OpenAI request bodies (pydantic) and response bodies (plain dicts), as the official client
sends and reads them.

Every field a body may carry is listed here (docs/router.md has the table): a field orch does
not know is a 400 naming it (never silently dropped), and so is a known one it cannot honour
(``echo``, ``best_of``, ``suffix``, ``logit_bias``, audio, ...; :data:`REFUSED`). Types are
strict, as OpenAI's are (``"stream": "yes"`` or ``"max_tokens": true`` is a 400, an integer
where a number goes is fine), and every optional field may be ``null`` (its default).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from orchestrator.router.fan_out import MAX_CHOICES as MAX_N
from orchestrator.router.stop_text import MAX_STOP_STRINGS
from orchestrator.router.request import RequestError

MAX_TOOLS = 128
# Known OpenAI fields orch refuses, with what to do instead.
REFUSED = {
    "logit_bias": "omit it", "echo": "omit it (send the prompt again yourself)",
    "best_of": "use n and pick yourself", "suffix": "omit it (no fill-in-the-middle)",
    "functions": "use tools", "function_call": "use tool_choice",
    "audio": "omit it (text only)", "modalities": "omit it (text only)",
    "prediction": "omit it", "service_tier": "omit it", "store": "omit it",
    "metadata": "omit it", "reasoning_effort": "use chat_template_kwargs.thinking",
    "web_search_options": "omit it", "verbosity": "omit it",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class GenerationRequest(_Strict):
    """Fields both endpoints share. None means "the OpenAI default"."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None  # OpenAI's default: 1
    top_p: float | None = None  # OpenAI's default: 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # an end-user id for the caller's own records: not used
    # vLLM's extensions
    top_k: int | None = None  # 0: off
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    # refused (REFUSED says what to do); typed loosely so the refusal names them
    logit_bias: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None

    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings (at most MAX_STOP_STRINGS).

        Raises:
            RequestError: too many, or an empty one (it would stop at once; gRPC refuses it too).
        """
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise RequestError("INVALID_ARGUMENT", f"stop has {len(stops)} strings; at most "
                                                   f"{MAX_STOP_STRINGS} are allowed")
        for i, stop in enumerate(stops):
            if not stop:
                where = "stop" if isinstance(self.stop, str) else f"stop[{i}]"
                raise RequestError("INVALID_ARGUMENT", f"{where} is empty: drop it")
        return tuple(stops)

    def check_supported(self) -> None:
        """Refuse what orch cannot do (INVALID_ARGUMENT naming it)."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("INVALID_ARGUMENT", "stream_options is only allowed when stream "
                                                   "is true: set stream or drop stream_options")
        for name, what in REFUSED.items():
            value = getattr(self, name, None)
            if value is not None and value is not False and value != {} and value != []:
                raise RequestError("INVALID_ARGUMENT", f"{name} is not supported by orch: "
                                                       f"{what} (docs/router.md lists every "
                                                       "field)")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def top_logprobs_count(self) -> int | None:
        """Alternatives per token, or None when logprobs are off (per endpoint)."""
        raise NotImplementedError


class CompletionRequest(GenerationRequest):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)

    def check_supported(self) -> None:
        super().check_supported()
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

    @property
    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One message; the fields beyond role/content (name, tool_calls, tool_call_id,
    reasoning_content) reach the template; any other field is a 400 naming it. ``refusal``
    (null in replayed assistant turns) is accepted and dropped."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the template reads it: content as one string, or None (kept: an
        assistant turn with ``tool_calls`` has ``content: null``, which templates test for)."""
        out = self.model_dump(exclude_none=True)
        out["content"] = "".join(part.text for part in self.content) \
            if isinstance(self.content, list) else self.content
        return out


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow the schema when a grammar applies


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatTemplateKwargs(_Strict):
    thinking: bool | None = None  # DeepSeek-V3.1+ templates: reasoning on / off


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise RequestError("INVALID_ARGUMENT", "top_logprobs needs logprobs: true")
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and (rf.json_schema is None or
                                                             rf.json_schema.schema_ is None):
            raise RequestError("INVALID_ARGUMENT", "response_format json_schema needs "
                                                   "json_schema.schema")
        if rf is not None and rf.type != "text" and self.tool_grammar_needed:
            raise RequestError("INVALID_ARGUMENT", "response_format and tool_choice "
                                                   "required/named both constrain the output: "
                                                   "send one of them")

    @property
    def token_budget(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (fill the context)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    @property
    def tool_choice_value(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" with tools, else "none"."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        if isinstance(self.tool_choice, str):
            return self.tool_choice
        return self.tool_choice.model_dump()

    @property
    def tool_grammar_needed(self) -> bool:
        return self.tool_choice_value not in ("auto", "none")

    def response_schema(self) -> str | None:
        """The JSON Schema (as text) the output must follow, or None."""
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return json.dumps({"type": "object"})
        return json.dumps(rf.json_schema.schema_)


def validation_message(exc: ValidationError) -> str:
    """A pydantic error as one line naming each bad field."""
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            parts.append(f"{where}: is not a field orch knows: remove it (docs/router.md "
                         "lists every supported field)")
        else:
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

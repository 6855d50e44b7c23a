"""The checkpoint's own chat template (``tokenizer_config.json``), rendered with jinja2.

Rendered as HF transformers' ``apply_chat_template``: a sandboxed, immutable environment with
``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``tojson``, ``raise_exception`` and
``strftime_now``; the template sees ``messages``, ``add_generation_prompt`` and the config's
special tokens, and cannot read files or call Python it was not given.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from orchestrator.router.request import RequestError

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """``tokenizer_config.json`` has no usable chat template (the message says what to do)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


class ChatTemplate:
    """One compiled chat template and its special tokens (name "bos_token", ... -> text).

    Raises:
        ChatTemplateError: the template does not compile.
    """

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile ({exc}): fix "
                                    "chat_template in tokenizer_config.json") from None
        self.source = source
        self.special_tokens = dict(special_tokens)

    def reads(self, word: str) -> bool:
        """The template's text holds ``word`` (a variable it reads, a format it writes)."""
        return word in self.source

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "ChatTemplate":
        """The template of ``checkpoint_dir/tokenizer_config.json`` (``chat_template``: a
        string, or a list of ``{name, template}`` of which "default" is used).

        Raises:
            ChatTemplateError: no tokenizer_config.json, no chat_template in it, or it does
                not compile.
        """
        path = Path(checkpoint_dir) / "tokenizer_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ChatTemplateError(f"cannot read {path} ({exc}): chat completions need the "
                                    "checkpoint's tokenizer_config.json") from None
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            raise ChatTemplateError(f"{path} has no chat_template: add the model's template "
                                    "there, or use /v1/completions")
        return cls(source, {k: _token_text(config.get(k)) for k in SPECIAL_TOKEN_KEYS})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **extra: Any) -> str:
        """The prompt text of ``messages`` (``{"role", "content", ...}`` in order);
        ``add_generation_prompt`` ends with the assistant's turn header; ``extra``: more
        variables the template reads (``tools``, ``thinking``).

        Raises:
            RequestError: INVALID_ARGUMENT when the template refuses the conversation (its
                own ``raise_exception`` message, e.g. roles out of order), or fails on a value
                of the wrong type in it (a null user ``content``, tool call ``arguments`` that
                are an object where the template joins strings).
        """
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **extra)
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            raise RequestError("INVALID_ARGUMENT", f"the model's chat template refused these "
                                                   f"messages: {exc}") from None

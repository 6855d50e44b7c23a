"""``tools`` and ``tool_choice``: how the prompt tells the model its tools, and the grammar
that makes ``required`` / a named choice produce a tool call.

The prompt: a chat template that reads ``tools`` renders them itself (DeepSeek-V3.1's does);
one that does not (DeepSeek-V3's) gets them as a system message in DeepSeek-V3.1's own tool
section words. The grammar (llguidance Lark, ``%json`` for the arguments' schema) writes the
call in the format the template itself uses for earlier calls: V3's
``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```}`` when it writes that, else V3.1's
``NAME<｜tool▁sep｜>ARGS``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from orchestrator.api.http.deepseek_output import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END,
                                                   SEP, V3_ARGS_CLOSE, V3_ARGS_OPEN)
from orchestrator.router.request import RequestError

TOOLS_HEADER = ("## Tools\nYou have access to the following tools:\n")
TOOLS_FOOTER = ("IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
                f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
                "{{additional_tool_calls}}" f"{CALLS_END}\n\nWhere:\n"
                "- `tool_call_name` must be an exact match to one of the available tools\n"
                "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
                "Parameters Schema\n")


def _invalid(message: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", message)


def tools_system_text(tools: list[dict[str, Any]]) -> str:
    """DeepSeek-V3.1's tool section for ``tools`` (OpenAI ``{"type": "function",
    "function": {"name", "description", "parameters"}}`` entries)."""
    parts = [TOOLS_HEADER]
    for tool in tools:
        fn = tool["function"]
        parts.append(f"\n### {fn['name']}\nDescription: {fn.get('description', '')}\n\n"
                     f"Parameters: {json.dumps(fn.get('parameters', {}), ensure_ascii=False)}\n")
    parts.append("\n" + TOOLS_FOOTER)
    return "".join(parts)


def chosen_tools(tools: list[dict[str, Any]], choice: str | dict[str, Any]
                 ) -> list[dict[str, Any]] | None:
    """The tools a call must be made to (``required``: any; named: that one), or None when the
    model may answer in text (``auto``, ``none``).

    Raises:
        RequestError: INVALID_ARGUMENT when a named tool is not in ``tools``, or a choice
            needs tools and there are none.
    """
    if choice in ("auto", "none"):
        return None
    if not tools:
        raise _invalid(f"tool_choice {json.dumps(choice)} needs tools: send tools")
    if choice == "required":
        return tools
    name = choice["function"]["name"]
    named = [t for t in tools if t["function"]["name"] == name]
    if not named:
        raise _invalid(f"tool_choice names function '{name}', which is not in tools: "
                       f"send one of {[t['function']['name'] for t in tools]}")
    return named


MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)


def _lark_seq(parts: list[str], token_id: Callable[[str], int | None]) -> str:
    """Lark for ``parts`` in a row: a marker that is one token of the vocabulary as that token
    (``<[id]>``: llguidance matches special tokens by id, never by their text), the rest as
    string literals."""
    out = []
    for part in parts:
        tid = token_id(part) if part in MARKERS else None
        out.append(f"<[{tid}]>" if tid is not None else json.dumps(part, ensure_ascii=False))
    return " ".join(out)


def tool_call_grammar(tools: list[dict[str, Any]], v3_format: bool, parallel: bool,
                      token_id: Callable[[str], int | None]) -> str:
    """llguidance Lark: one call (``parallel``: one or more) to one of ``tools``, its
    arguments valid against the tool's ``parameters`` schema, then the end of the output.
    ``token_id``: a text's token id when it is one token of the vocabulary, else None."""
    names, rules = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        # NOTE: compact JSON, as for response_format (engine/grammar.py): no whitespace runs
        schema = json.dumps({**(fn.get("parameters") or {"type": "object"}),
                             "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)
        if v3_format:
            head = _lark_seq(["function", SEP, fn["name"] + V3_ARGS_OPEN], token_id)
            rules.append(f"fn_{i}: {head} args_{i} {_lark_seq([V3_ARGS_CLOSE], token_id)}")
        else:
            rules.append(f"fn_{i}: {_lark_seq([fn['name'], SEP], token_id)} args_{i}")
        rules.append(f"args_{i}: %json {schema}")
        names.append(f"fn_{i}")
    repeat = "+" if parallel else ""
    return "\n".join([
        f"start: {_lark_seq([CALLS_BEGIN], token_id)} call{repeat} "
        f"{_lark_seq([CALLS_END], token_id)}",
        f"call: {_lark_seq([CALL_BEGIN], token_id)} ({' | '.join(names)}) "
        f"{_lark_seq([CALL_END], token_id)}",
        *rules])

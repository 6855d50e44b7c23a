"""DeepSeek's assistant output -> OpenAI's ``reasoning_content``, ``content`` and
``tool_calls``, whole or as streamed deltas.

Formats (DeepSeek's model cards and chat templates):

- reasoning: ``<think>REASONING</think>CONTENT`` (R1, V3.1+ thinking mode; the generation prompt
  may already end with ``<think>``, then the output starts inside the reasoning);
- V3 / R1 tool calls: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
  ```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``;
- V3.1 tool calls: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``;
- V3.2 tool calls (DSML): ``<｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n
  <｜DSML｜parameter name="P" string="true">VALUE</｜DSML｜parameter>\\n...</｜DSML｜invoke>\\n
  </｜DSML｜function_calls>`` (``string="false"``: VALUE is JSON).

Streaming: :class:`OutputStream` parses the whole text so far on each piece and sends what grew
since the last piece, holding back a tail that may still become a marker; so the deltas of a
stream, joined, equal the whole parse however the text was split.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V3_ARGS_OPEN, V3_ARGS_CLOSE = "\n```json\n", "\n```"
DSML_BEGIN, DSML_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
DSML_INVOKE_END = "</｜DSML｜invoke>"
_DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]*)">(.*?)</｜DSML｜invoke>', re.S)
_DSML_PARAM = re.compile(
    r'<｜DSML｜parameter name="([^"]*)" string="(true|false)">(.*?)</｜DSML｜parameter>', re.S)


@dataclass
class ParsedCall:
    """One tool call as far as it is known: ``name`` None until it is complete."""

    name: str | None
    arguments: str = ""


@dataclass
class Parsed:
    """The output's parts as far as they are known."""

    reasoning: str = ""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def _until(text: str, marker: str, final: bool) -> tuple[str, bool]:
    """(text before ``marker``, found); not found and not ``final``: a possible partial marker
    at the end is held back."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], True
    return (text if final else text[:len(text) - _held(text, (marker,))]), False


def parse(text: str, final: bool, in_reasoning: bool = False, tools: bool = True) -> Parsed:
    """Parse ``text`` (the output so far; ``final``: all of it). ``in_reasoning``: the prompt
    ended inside ``<think>``; ``tools``: tool-call markers start tool calls (else content)."""
    out = Parsed()
    rest = text
    if not in_reasoning and rest.startswith(THINK_START):
        in_reasoning, rest = True, rest[len(THINK_START):]
    elif not in_reasoning and not final and THINK_START.startswith(rest):
        return out  # may still become "<think>"
    if in_reasoning:
        out.reasoning, found = _until(rest, THINK_END, final)
        if not found:
            return out
        rest = rest[len(out.reasoning) + len(THINK_END):]
    if not tools:
        out.content = rest if final else rest[:len(rest) - _held(rest, ())]
        return out
    starts = [(rest.find(m), m) for m in (CALLS_BEGIN, DSML_BEGIN) if rest.find(m) >= 0]
    if not starts:
        out.content = rest if final else rest[:len(rest) - _held(rest, (CALLS_BEGIN,
                                                                         DSML_BEGIN))]
        return out
    at, marker = min(starts)
    out.content = rest[:at]
    body = rest[at + len(marker):]
    out.calls = _dsml_calls(body) if marker == DSML_BEGIN else _calls(body, final)
    return out


def _calls(body: str, final: bool) -> list[ParsedCall]:
    """V3 / V3.1 calls in ``body`` (after ``<｜tool▁calls▁begin｜>``)."""
    calls = []
    for part in body.split(CALL_BEGIN)[1:]:
        head, has_sep = _until(part, SEP, final)
        if not has_sep:
            break
        after = part[len(head) + len(SEP):]
        if head == "function":  # V3: type, then "NAME\n```json\n"
            name, has_open = _until(after, V3_ARGS_OPEN, final)
            if not has_open:
                break
            args, _ = _until(after[len(name) + len(V3_ARGS_OPEN):], V3_ARGS_CLOSE, final)
        else:
            name = head
            args, _ = _until(after, CALL_END, final)
        calls.append(ParsedCall(name, args))
    return calls


def _dsml_calls(body: str) -> list[ParsedCall]:
    """V3.2 DSML invokes in ``body``: each one once it is complete (its arguments are built
    from all its parameters)."""
    calls = []
    for match in _DSML_INVOKE.finditer(body):
        args: dict[str, Any] = {}
        for name, is_string, value in _DSML_PARAM.findall(match.group(2)):
            if is_string == "true":
                args[name] = value
            else:
                try:
                    args[name] = json.loads(value)
                except ValueError:
                    args[name] = value
        calls.append(ParsedCall(match.group(1), json.dumps(args, ensure_ascii=False)))
    return calls


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class OutputStream:
    """Turns a chat choice's text pieces into OpenAI deltas (module docstring).

    Args:
        in_reasoning: the prompt ends inside ``<think>`` (thinking mode on).
        tools: the request has tools and ``tool_choice`` is not "none".
    """

    def __init__(self, in_reasoning: bool, tools: bool) -> None:
        self.in_reasoning, self.tools = in_reasoning, tools
        self.text = ""
        self._sent = Parsed()
        self.call_ids: list[str] = []

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        """Deltas (``{"reasoning_content"}``, ``{"content"}``, ``{"tool_calls"}``) that the
        text so far adds; ``final``: the text is complete (nothing is held back)."""
        self.text += piece
        now = parse(self.text, final, self.in_reasoning, self.tools)
        deltas: list[dict[str, Any]] = []
        for key, attr in (("reasoning_content", "reasoning"), ("content", "content")):
            new = getattr(now, attr)[len(getattr(self._sent, attr)):]
            if new:
                deltas.append({key: new})
        for i, call in enumerate(now.calls):
            deltas.extend(self._call_delta(i, call))
        self._sent = Parsed(now.reasoning, now.content,
                            [ParsedCall(c.name, c.arguments) for c in now.calls])
        return deltas

    def _call_delta(self, index: int, call: ParsedCall) -> list[dict[str, Any]]:
        if index >= len(self._sent.calls):
            self.call_ids.append(new_call_id())
            return [{"tool_calls": [{"index": index, "id": self.call_ids[index],
                                     "type": "function",
                                     "function": {"name": call.name,
                                                  "arguments": call.arguments}}]}]
        new = call.arguments[len(self._sent.calls[index].arguments):]
        if not new:
            return []
        return [{"tool_calls": [{"index": index, "function": {"arguments": new}}]}]

    def message(self) -> dict[str, Any]:
        """The whole assistant message of the text fed so far (as final)."""
        parsed = parse(self.text, True, self.in_reasoning, self.tools)
        while len(self.call_ids) < len(parsed.calls):
            self.call_ids.append(new_call_id())
        msg: dict[str, Any] = {"role": "assistant",
                               "content": parsed.content or (None if parsed.calls else "")}
        if parsed.reasoning or self.in_reasoning:
            msg["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            msg["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for cid, c in zip(self.call_ids, parsed.calls)]
        return msg

    @property
    def has_calls(self) -> bool:
        return bool(self._sent.calls)

"""DeepSeek output parsing (orchestrator/api/http/deepseek_output.py) on the formats of
DeepSeek's model cards: V3 / R1, V3.1 and V3.2 (DSML) tool calls, <think> reasoning; streamed
deltas, split at every character, join to the whole parse."""

from __future__ import annotations

import json

import pytest

from orchestrator.api.http.deepseek_output import OutputStream, parse

ARGS = '{"location": "Hangzhou", "days": 3}'
V3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
      f"{ARGS}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n"
      "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V31 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
       f"{ARGS}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{{}}"
       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V32 = ("<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
       "<｜DSML｜parameter name=\"location\" string=\"true\">Hangzhou</｜DSML｜parameter>\n"
       "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
       "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_time\">\n</｜DSML｜invoke>\n"
       "</｜DSML｜function_calls>")
CASES = {
    "v3": ("Let me check. " + V3, False),
    "v3.1": ("Let me check. " + V31, False),
    "v3.2": ("Let me check. " + V32, False),
    "r1 think": ("<think>The user wants weather.</think>Let me check. " + V31, False),
    "thinking prompt": ("The user wants weather.</think>Let me check. " + V3, True),
}


@pytest.mark.parametrize("name", CASES)
def test_whole_output_parses_into_reasoning_content_and_calls(name):
    text, in_reasoning = CASES[name]
    stream = OutputStream(in_reasoning, tools=True)
    stream.feed(text, final=True)
    msg = stream.message()
    assert msg["content"] == "Let me check. "
    want_reasoning = "The user wants weather." if "think" in name else None
    assert msg.get("reasoning_content") == want_reasoning
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"location": "Hangzhou", "days": 3}), ("get_time", {})]


@pytest.mark.parametrize("name", CASES)
def test_deltas_split_at_every_character_join_to_the_whole(name):
    text, in_reasoning = CASES[name]
    whole = OutputStream(in_reasoning, tools=True)
    whole.feed(text, final=True)
    want = whole.message()
    stream = OutputStream(in_reasoning, tools=True)
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.feed("", final=True)
    got = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict] = {}
    for d in deltas:
        for key in ("content", "reasoning_content"):
            got[key] += d.get(key, "")
        for call in d.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:
                assert entry["name"] is None, "a call's header is sent once"
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
    assert got["content"] == want["content"]
    assert got["reasoning_content"] == (want.get("reasoning_content") or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in want["tool_calls"]]
    # NOTE: V3 / V3.1 arguments stream as they come (DSML's are built at the invoke's end)
    args_deltas = sum(1 for d in deltas for c in d.get("tool_calls", ()) if "id" not in c)
    assert args_deltas == 0 if "v3.2" in name else args_deltas > len(ARGS) // 2


def test_text_without_markers_is_content_and_tool_markers_without_tools_too():
    assert parse("hello <｜tool▁ca", final=False) == parse("hello ", final=True)
    assert parse("hello <｜tool▁ca", final=True).content == "hello <｜tool▁ca"
    assert parse(V31, final=True, tools=False).content == V31
    assert parse("<thi", final=False).content == ""  # may still become <think>
    assert parse("<thx", final=False).content == "<thx"


def test_unfinished_call_is_left_out_of_the_whole_message():
    cut = V31[:V31.index("get_time")]
    stream = OutputStream(False, tools=True)
    stream.feed(cut, final=True)
    assert [c["function"]["name"] for c in stream.message()["tool_calls"]] == ["get_weather"]

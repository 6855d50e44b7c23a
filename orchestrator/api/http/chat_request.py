"""A chat request's prompt and constraints: the messages (and tools, and the thinking switch)
rendered through the checkpoint's chat template, the grammar the output must follow
(``response_format``, or ``tool_choice`` required / named), and how to parse the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.sampling_params import GrammarSpec
from orchestrator.api.http.chat_template import ChatTemplate
from orchestrator.api.http.deepseek_output import THINK_START, V3_ARGS_OPEN
from orchestrator.api.http.openai_schema import ChatCompletionRequest
from orchestrator.api.http.tools import chosen_tools, tool_call_grammar, tools_system_text
from orchestrator.router.request import RequestError


@dataclass(frozen=True)
class ChatPlan:
    """What to generate for one chat request.

    Attributes:
        prompt: the rendered prompt text.
        grammar: the output's grammar, or None.
        in_reasoning: the prompt ends inside ``<think>`` (the output starts as reasoning).
        parse_tools: tool-call markers in the output become ``tool_calls``.
    """

    prompt: str
    grammar: GrammarSpec | None
    in_reasoning: bool
    parse_tools: bool


def plan_chat(template: ChatTemplate, req: ChatCompletionRequest,
              token_id: Callable[[str], int | None]) -> ChatPlan:
    """:class:`ChatPlan` of ``req`` (blocking: the template renders here); ``token_id``: a
    text's token id when it is one token of the vocabulary (tool-call markers), else None.

    Raises:
        RequestError: INVALID_ARGUMENT: the template refuses the messages, thinking is asked of
            a template without the switch, or tool_choice names an unknown tool.
    """
    messages = [m.for_template() for m in req.messages]
    tools, choice = req.tool_dicts, req.tool_choice_value
    use_tools = bool(tools) and choice != "none"
    extra = {}
    if use_tools and template.reads("tools"):
        extra["tools"] = tools
    elif use_tools:
        messages = [{"role": "system", "content": tools_system_text(tools)}, *messages]
    thinking = req.chat_template_kwargs.thinking if req.chat_template_kwargs else None
    if thinking is not None:
        if not template.reads("thinking"):
            raise RequestError("INVALID_ARGUMENT", "chat_template_kwargs.thinking: this model's "
                                                   "chat template has no thinking switch: "
                                                   "omit it")
        extra["thinking"] = thinking
    prompt = template.render(messages, **extra)
    return ChatPlan(prompt, _grammar(template, req, tools, choice, token_id),
                    prompt.rstrip().endswith(THINK_START), use_tools)


def _grammar(template: ChatTemplate, req: ChatCompletionRequest, tools: list,
             choice: str | dict, token_id: Callable[[str], int | None]) -> GrammarSpec | None:
    schema = req.response_schema()
    if schema is not None:
        return GrammarSpec("json_schema", schema)
    must = chosen_tools(tools, choice)
    if must is None:
        return None
    parallel = req.parallel_tool_calls is not False
    return GrammarSpec("lark", tool_call_grammar(must, template.reads(V3_ARGS_OPEN.strip()),
                                                 parallel, token_id))

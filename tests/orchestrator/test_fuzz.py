"""Fuzz the router's edge (issue 10): 10,000 random GenerateRequests, every field at and past
its limits with random unicode, plus 1,000 raw byte blobs, against a real grpc.aio server on
127.0.0.1 over fake leaders. The server never crashes, every invalid request gets
INVALID_ARGUMENT, every valid one streams its scripted tokens, the log stays bounded (no
warning, no traceback, at most one line per refused request), nothing leaks, and a normal
request succeeds afterwards.

Fast enough for CI on a loaded 2-core machine: in-process, 64 calls in flight, seeded.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from engine.sampling_params import SamplingParams
from orchestrator.api.client import OrchClient
from orchestrator.router.limits import max_request_bytes
from orchestrator.api.rpc import orch_pb2 as pb
from tests.orchestrator.fakes import VOCAB, expected_tokens
from tests.orchestrator.harness import MODEL, TOKENIZER, Harness

N_REQUESTS = 10_000
N_BLOBS = 1_000
SEED = 20261130
IN_FLIGHT = 64
GENERATE = "/orch.v1.Orch/Generate"
MAX_LEN = MODEL.max_model_len
LIMIT = max_request_bytes(MAX_LEN, TOKENIZER.max_token_bytes)
# The rule the edge must enforce, written out independently of orchestrator.router.limits.
ID_RULE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ID_CHARS = "ABCxyz0189._:-"
INT32 = (-2**31, -1, 0, 2**31 - 1)


@dataclass(frozen=True)
class Expected:
    """What the server must answer: tokens (valid) or None (INVALID_ARGUMENT)."""

    tokens: tuple[int, ...] | None


# ---- the oracle -------------------------------------------------------------------------

def expect(payload: bytes) -> Expected:
    """What a correct edge answers to ``payload`` (see docs/router.md, Ending)."""
    if len(payload) > LIMIT:
        return Expected(None)
    try:
        msg = pb.GenerateRequest.FromString(payload)
    except DecodeError:
        return Expected(None)
    if msg.request_id and not ID_RULE.fullmatch(msg.request_id):
        return Expected(None)
    which, s = msg.WhichOneof("prompt"), msg.sampling
    if which is None or s.max_tokens < 1:
        return Expected(None)
    try:  # NOTE: sampling ranges are SamplingParams' own rule (tested in tests/engine)
        SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                       top_p=s.top_p or 1.0, seed=s.seed if s.HasField("seed") else None)
    except ValueError:
        return Expected(None)
    if which == "text" and len(msg.text.encode()) > MAX_LEN * TOKENIZER.max_token_bytes:
        return Expected(None)
    ids = TOKENIZER.encode(msg.text) if which == "text" else list(msg.token_ids.ids)
    if not ids or any(not 0 <= t < VOCAB for t in ids) or len(ids) + s.max_tokens > MAX_LEN:
        return Expected(None)
    return Expected(tuple(expected_tokens(tuple(ids), s.max_tokens, s.ignore_eos)))


# ---- random requests ----------------------------------------------------------------------

def _unicode(rng: random.Random, n: int) -> str:
    """Random code points from every plane (no surrogates: a str cannot carry them in UTF-8)."""
    out = []
    for _ in range(n):
        top = rng.choice((0x7F, 0x7FF, 0xFFFF, 0x10FFFF))
        cp = rng.randint(0, top)
        out.append(chr(cp if not 0xD800 <= cp <= 0xDFFF else 0xFFFD))
    return "".join(out)


def _request_id(rng: random.Random, i: int) -> str:
    kind = rng.random()
    unique = f"{i}."
    if kind < 0.25:
        return ""
    if kind < 0.6:
        return unique + "".join(rng.choice(ID_CHARS) for _ in range(rng.randint(0, 40)))
    if kind < 0.7:  # exactly at, or one past, the length limit
        return unique.ljust(rng.choice((128, 129)), "x")
    if kind < 0.8:
        return unique + rng.choice((" ", "\t", "\n", "\0", "\x7f", "/", "é", "\u202e"))
    if kind < 0.99:
        return _unicode(rng, rng.randint(1, 60))
    return unique * rng.randint(3_000, 30_000)  # a long id echoed in every message


def _prompt(rng: random.Random, msg: pb.GenerateRequest) -> None:
    kind = rng.random()
    if kind < 0.03:
        return  # no prompt
    if kind < 0.33:
        msg.text = _unicode(rng, rng.choice((0, 1, rng.randint(1, 300))))
    elif kind < 0.53:
        msg.text = " ".join(rng.choice(("hello", "KV", "décode", "日本", "😀", "\n"))
                            for _ in range(rng.randint(1, 200)))
    elif kind < 0.9:
        n = rng.choice((0, 1, MAX_LEN - 1, MAX_LEN, MAX_LEN + 1, rng.randint(1, 200)))
        msg.token_ids.ids.extend(rng.randrange(VOCAB) for _ in range(n))
    elif kind < 0.997:
        ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        ids[rng.randrange(len(ids))] = rng.choice((-1, VOCAB, VOCAB - 1, *INT32))
        msg.token_ids.ids.extend(ids)
    else:  # past the text limit, the request limit, gRPC's 4 MiB default
        text_limit = MAX_LEN * TOKENIZER.max_token_bytes
        msg.text = "a" * rng.choice((text_limit, text_limit + 1, LIMIT + 1, 5 * 1024 * 1024))


def _pick(rng: random.Random, usual: tuple, edges: tuple, p_edge: float = 0.15):
    """A usual value, or with probability ``p_edge`` one at or past a limit."""
    return rng.choice(edges if rng.random() < p_edge else usual)


def _sampling(rng: random.Random, msg: pb.GenerateRequest, prompt_len: int) -> None:
    s = msg.sampling
    s.max_tokens = _pick(rng, (1, rng.randint(1, 16)),
                         (*INT32, MAX_LEN - prompt_len, MAX_LEN - prompt_len + 1))
    # NOTE: float fields hold float32; the oracle reads the values back from the bytes.
    s.temperature = _pick(rng, (0.0, 0.7, rng.uniform(0, 5)),
                          (-0.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e-38,
                           1e-45, 3.4e38))
    s.top_p = _pick(rng, (0.0, 1.0, rng.random()),
                    (1.0000001, -0.1, float("nan"), 1e-30, 1e-45))
    s.top_k = _pick(rng, (0, 1, 50), (*INT32, VOCAB + 1))
    seed = _pick(rng, (None, rng.randrange(2**62)), (0, 2**63 - 1, -1, -2**63))
    if seed is not None:
        s.seed = seed
    s.ignore_eos = rng.random() < 0.5
    if rng.random() < 0.02:
        msg.ClearField("sampling")


def random_request(rng: random.Random, i: int, used_ids: set[str]) -> bytes:
    """One random request; a valid request_id is never used twice (duplicates in flight are
    refused, which the oracle does not model)."""
    request_id = _request_id(rng, i)
    while request_id in used_ids:
        request_id = _request_id(rng, i)
    if ID_RULE.fullmatch(request_id):
        used_ids.add(request_id)
    msg = pb.GenerateRequest(request_id=request_id)
    _prompt(rng, msg)
    n = len(msg.token_ids.ids) if msg.WhichOneof("prompt") == "token_ids" else rng.randint(1, 99)
    _sampling(rng, msg, n)
    return msg.SerializeToString()


def random_blob(rng: random.Random, base: list[bytes], i: int) -> bytes:
    """Random bytes, or a valid request (id ``b<i>``) mutated, truncated or with bad UTF-8."""
    kind = rng.random()
    if kind < 0.3:
        return rng.randbytes(rng.randint(0, 200))
    msg = pb.GenerateRequest.FromString(rng.choice(base))
    msg.request_id = f"b{i}"
    raw = bytearray(msg.SerializeToString())
    if kind < 0.6 and raw:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw)
    if kind < 0.75:
        return bytes(raw[:rng.randint(0, max(len(raw) - 1, 0))])
    if kind < 0.9:  # a string field (text 1 or request_id 4) that is not UTF-8
        bad = rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"a\x80b", b"\xf4\x90\x80\x80"))
        return bytes(raw) + bytes([rng.choice((0x0A, 0x22)), len(bad)]) + bad
    if kind < 0.99:  # lengths past the end, deep groups, unknown fields
        return rng.choice((b"\x0a\xff\xff\xff\xff\x0f", b"\x0b" * 200, b"\x1a\x05\x20",
                           bytes(raw) + b"\xf8\xff\xff\xff\x0f\x01"))
    return rng.randbytes(5 * 1024 * 1024)  # over gRPC's default limit


# ---- sending ------------------------------------------------------------------------------

async def _send(call, payload: bytes) -> tuple[str, tuple[int, ...] | str]:
    """("OK", tokens) or (status code name, details)."""
    try:
        responses = [pb.GenerateResponse.FromString(r) async for r in call(payload, timeout=60)]
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""
    finish = responses[-1].finish_reason if responses else ""
    if finish not in ("stop", "length"):
        return "BAD_FINISH", finish
    return "OK", tuple(t for r in responses for t in r.token_ids)


async def send_all(address: str, payloads: list[bytes]) -> list[tuple]:
    sem = asyncio.Semaphore(IN_FLIGHT)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(GENERATE)  # identity serializers: raw bytes go out

        async def one(p: bytes):
            async with sem:
                return await _send(call, p)
        return await asyncio.gather(*(one(p) for p in payloads))


def _check(payloads: list[bytes], wants: list[Expected], outcomes: list[tuple]) -> int:
    """Asserts each outcome; returns how many payloads were invalid."""
    invalid = 0
    for i, (payload, want, (code, got)) in enumerate(zip(payloads, wants, outcomes)):
        if want.tokens is None:
            invalid += 1
            assert code == "INVALID_ARGUMENT", (i, code, got, payload[:200])
            assert len(got) < 500, (i, got[:600])
        else:
            assert (code, got) == ("OK", want.tokens), (i, code, got, payload[:200])
    return invalid


def test_fuzz_requests_and_blobs(caplog):
    caplog.set_level(logging.DEBUG, logger="orchestrator")
    rng = random.Random(SEED)
    used_ids: set[str] = set()
    requests = [random_request(rng, i, used_ids) for i in range(N_REQUESTS)]
    request_wants = [expect(p) for p in requests]
    valid = [p for p, want in zip(requests, request_wants) if want.tokens is not None]
    blobs = [random_blob(rng, valid, i) for i in range(N_BLOBS)]
    blob_wants = [expect(p) for p in blobs]
    h = Harness(max_pending=N_REQUESTS, decode_capacity=N_REQUESTS, request_timeout_s=60)
    try:
        start = time.monotonic()
        invalid = _check(requests, request_wants, asyncio.run(send_all(h.address, requests)))
        invalid += _check(blobs, blob_wants, asyncio.run(send_all(h.address, blobs)))
        took = time.monotonic() - start
        assert 1_000 < len(valid) < N_REQUESTS - 1_000, len(valid)  # both kinds well covered
        with OrchClient(h.address) as client:
            _, ids, _ = client.generate_text(token_ids=[5, 6], max_tokens=3, ignore_eos=True)
        assert ids == expected_tokens((5, 6), 3)
        assert h.call_in_loop(lambda: (h.router.in_flight, dict(h.fakes["decode-0"].reserved))
                              ) == (0, {})
    finally:
        h.close()
    loud = [r.getMessage()[:200] for r in caplog.records
            if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == []
    orch_lines = [r for r in caplog.records if r.name.startswith("orchestrator")]
    assert len(orch_lines) <= invalid, (len(orch_lines), invalid)
    print(f"fuzz: {N_REQUESTS + N_BLOBS} calls ({invalid} invalid) in {took:.1f} s")

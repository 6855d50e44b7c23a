"""Nothing one client sends may stall others (issue 25, item 2): a flood of big chat bodies
(just under the body limit, tens of thousands of messages each, all refused) beside streams
that get a token every 10 ms; the largest gap between two chunks of a healthy stream stays
under ``MAX_GAP_S``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from orchestrator.api.client import OrchClient
from tests.orchestrator.fakes import expected_tokens
from tests.orchestrator.test_http_api import HttpHarness

MAX_GAP_S = 0.5
STREAMS, STREAM_TOKENS, TOKEN_EVERY_S = 4, 200, 0.01
FLOOD, FLOOD_THREADS = 40, 8


def _pace(h: HttpHarness) -> list[asyncio.Task]:
    """Make decode-0 emit one token every TOKEN_EVERY_S (the fake emits all at once)."""
    fake, drips = h.fakes["decode-0"], []

    async def admit(request_id: str, first_token_id: int) -> None:
        spec = fake.reserved.pop(request_id)
        rest = expected_tokens(spec.prompt_token_ids, spec.sampling.max_tokens)[1:]

        async def drip() -> None:
            for i, tok in enumerate(rest):
                await asyncio.sleep(TOKEN_EVERY_S)
                fake.emit(request_id, (tok,), "length" if i == len(rest) - 1 else None)
        drips.append(asyncio.get_running_loop().create_task(drip()))
    fake.admit = admit
    return drips


def _big_chat_body(limit: int) -> bytes:
    """A chat body of tens of thousands of short messages, just under ``limit`` bytes."""
    one = {"role": "user", "content": "hello"}
    n = (limit - 200) // len(json.dumps(one) + ", ")
    return json.dumps({"model": "fake", "messages": [one] * n, "max_tokens": 4}).encode()


def _stream_gaps(address: str, prompt: int) -> tuple[float, int]:
    """(largest gap between chunks after the first, tokens) of one streamed request."""
    tokens, last, gap = 0, None, 0.0
    with OrchClient(address) as client:
        for chunk in client.generate(token_ids=[prompt], max_tokens=STREAM_TOKENS,
                                     ignore_eos=True, timeout_s=60):
            now = time.monotonic()
            if last is not None:
                gap = max(gap, now - last)
            last, tokens = now, tokens + len(chunk.token_ids)
    return gap, tokens


def test_a_flood_of_big_chat_bodies_does_not_stall_other_streams():
    h = HttpHarness(request_timeout_s=60, decode_capacity=STREAMS + FLOOD)
    try:
        h.call_in_loop(lambda: _pace(h))
        body = _big_chat_body(_app_limit(h))
        assert len(json.loads(body)["messages"]) > 10_000
        answers: list[int] = []
        go = threading.Event()

        def flood() -> None:
            go.wait()
            with httpx.Client(timeout=60) as client:
                for _ in range(FLOOD // FLOOD_THREADS):
                    answers.append(client.post(
                        h.url + "/chat/completions", content=body,
                        headers={"content-type": "application/json"}).status_code)

        with ThreadPoolExecutor(STREAMS + FLOOD_THREADS) as pool:
            streams = [pool.submit(_stream_gaps, h.address, 3 + i) for i in range(STREAMS)]
            time.sleep(0.3)  # the streams run before the flood starts
            floods = [pool.submit(flood) for _ in range(FLOOD_THREADS)]
            go.set()
            results = [s.result(timeout=120) for s in streams]
            for f in floods:
                f.result(timeout=120)
        assert answers == [400] * FLOOD, answers
        assert [tokens for _, tokens in results] == [STREAM_TOKENS] * STREAMS
        worst = max(gap for gap, _ in results)
        print(f"largest token gap of a healthy stream: {worst:.3f} s")
        assert worst < MAX_GAP_S, f"a healthy stream waited {worst:.2f} s for a token"
    finally:
        h.close()


def _app_limit(h: HttpHarness) -> int:
    from orchestrator.api.http.app import JSON_ESCAPE_FACTOR
    from orchestrator.router.limits import max_request_bytes

    return JSON_ESCAPE_FACTOR * max_request_bytes(h.router.model.max_model_len,
                                                  h.router.tokenizer.max_token_bytes)

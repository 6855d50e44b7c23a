"""Replay against any OpenAI-compatible server (`orch bench --backend openai --base-url URL`):
``POST {base_url}/completions`` with ``stream: true``, timed per server-sent event.

Requests ask what the gRPC runner asks (``max_tokens = output_len``, greedy, ``ignore_eos``,
``stream_options.include_usage``). Each event with text counts one token and the final
``usage`` corrects the last, so totals are the server's count. Every wait is bounded (httpx
timeouts plus an asyncio backstop of ``request_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import httpx

from orchestrator.bench.records import RequestRecord, RunnerConfig, Send, StreamState
from orchestrator.bench.workloads import BenchRequest

_BACKSTOP_SLACK_S = 5.0
# HTTP status -> the gRPC status name the report counts failures by (others: "HTTP_<n>").
_STATUS_CODES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND",
                 429: "RESOURCE_EXHAUSTED", 500: "INTERNAL", 503: "UNAVAILABLE",
                 504: "DEADLINE_EXCEEDED"}


class OpenAIStream(StreamState):
    """One streamed completion: :class:`StreamState` fed from parsed ``data:`` events."""

    def add_event(self, data: dict, now: float) -> None:
        """One parsed ``data:`` event."""
        if "error" in data:
            err = data["error"] or {}
            self.code = str(err.get("code") or "STREAM_ERROR")
            self.error = str(err.get("message", err))
            return
        for choice in data.get("choices") or ():
            if choice.get("text"):
                self.times.append(now)
                self.tokens.append(1)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        usage = data.get("usage")
        if usage:
            self.input_len = int(usage.get("prompt_tokens") or self.input_len)
            details = usage.get("prompt_tokens_details") or {}
            self.cached_tokens = int(details.get("cached_tokens") or 0)
            self._settle(int(usage.get("completion_tokens") or 0))

    def _settle(self, total: int) -> None:
        """Make the per-event counts add up to the server's ``completion_tokens``."""
        missing = total - sum(self.tokens)
        if missing > 0 and self.tokens:
            self.tokens[-1] += missing


def completion_body(req: BenchRequest, model: str) -> dict:
    """The ``/completions`` body of ``req``: greedy, exactly ``output_len`` tokens, streamed."""
    prompt = req.prompt_text if req.prompt_text is not None \
        else req.prompt_token_ids.tolist()
    return {"model": model, "prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _consume(client: httpx.AsyncClient, body: dict, st: OpenAIStream,
                   t0: float) -> None:
    async with client.stream("POST", "/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            st.code, st.error = _http_error(resp.status_code, text)
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            st.add_event(json.loads(line[len("data: "):]), time.perf_counter() - t0)


def _http_error(status: int, text: str) -> tuple[str, str]:
    try:
        err = json.loads(text)["error"]
        return _STATUS_CODES.get(status, f"HTTP_{status}"), str(err.get("message", err))
    except (ValueError, KeyError, TypeError, AttributeError):
        return _STATUS_CODES.get(status, f"HTTP_{status}"), text[:500]


@asynccontextmanager
async def openai_sender(cfg: RunnerConfig) -> AsyncIterator[Send]:
    """A :data:`Send` of streamed completions to ``cfg.base_url`` (".../v1"); the model is
    ``cfg.model``, else the first id ``GET /models`` lists. ``cfg.token`` goes in an
    ``Authorization: Bearer`` header; an https URL is verified against ``cfg.tls_ca`` when
    given (else the system CAs).

    Raises:
        ConnectionError: nothing answered ``GET /models`` within ``cfg.connect_timeout_s``,
            it answered 401, or it listed no model.
        OSError: ``cfg.tls_ca`` cannot be read.
    """
    headers = {"Authorization": f"Bearer {cfg.token}"} if cfg.token else {}
    verify = ssl.create_default_context(cafile=cfg.tls_ca) if cfg.tls_ca else True
    base_url = (cfg.base_url or "").rstrip("/")
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout,
                                 limits=limits, verify=verify) as client:
        model = cfg.model or await _first_model(client, base_url, cfg.connect_timeout_s)

        async def send(req: BenchRequest, t0: float, run_id: str) -> RequestRecord:
            st = OpenAIStream(time.perf_counter() - t0, req.input_len)
            try:
                await asyncio.wait_for(_consume(client, completion_body(req, model), st, t0),
                                       cfg.request_timeout_s + _BACKSTOP_SLACK_S)
            except (httpx.TimeoutException, asyncio.TimeoutError):
                st.code, st.error = "DEADLINE_EXCEEDED", "client timeout"
            except httpx.HTTPError as exc:
                st.code, st.error = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"
            return st.record(req, time.perf_counter() - t0)

        yield send


async def _first_model(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> str:
    try:
        resp = await client.get("/models", timeout=timeout_s)
        models = (resp.json().get("data") or []) if resp.status_code == 200 else []
    except (httpx.HTTPError, ValueError) as exc:
        raise ConnectionError(f"no OpenAI-compatible server answered GET {base_url}/models "
                              f"within {timeout_s:g}s ({exc}): start one (orch up with "
                              "router.http_port) or fix --base-url") from None
    if resp.status_code == 401:
        raise ConnectionError(f"GET {base_url}/models answered 401 UNAUTHENTICATED: pass "
                              "--token-file FILE (or --api-key KEY, or set $ORCH_TOKEN)")
    if not models:
        raise ConnectionError(f"GET {base_url}/models answered {resp.status_code} with no "
                              "model: pass --model NAME (and --token-file if it needs a token)")
    return str(models[0]["id"])

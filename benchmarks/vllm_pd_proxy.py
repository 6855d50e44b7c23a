"""A two-hop OpenAI ``/v1/completions`` proxy in front of vLLM's prefill/decode disaggregation
(NixlConnector), the ``vllm-pd`` side of benchmarks/peer_bench.py (started by
benchmarks/vllm_pd.py as its own process, so the client's event loop does not share a GIL
with it).

The protocol is vLLM's (vllm/distributed/kv_transfer/kv_connector/v1/nixl: the scheduler
reads ``kv_transfer_params`` from the request, ``request_finished`` returns the ones the
decode side needs; vllm/entrypoints/openai/completion: the field is accepted in the request
and returned in the non-streamed response):

1. prefill hop (:func:`prefill_body`): the client's body, non-streamed, ``max_tokens`` 1, with
   ``kv_transfer_params`` ``{"do_remote_decode": true, "do_remote_prefill": false, ...}``: the
   prefill server computes the prompt's KV, keeps its blocks for the decode server to read
   (for ``kv_lease_duration`` seconds) and answers with their ``kv_transfer_params``
   (``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
   ``remote_port``, ...). Its one generated token is dropped.
2. decode hop (:func:`decode_body`): the client's body unchanged but for those
   ``kv_transfer_params``: the decode server reads the prompt's KV blocks from the prefill
   server over NIXL, computes the rest and streams every output token, the first included.
   Its response goes back to the client byte for byte.

Errors: a prefill hop that fails (HTTP status, no ``kv_transfer_params``, timeout) answers
the client with that status (502 for a missing field, 504 for a timeout) and the reason in
OpenAI's ``{"error": {...}}`` shape; the decode hop's status and body pass through.

Run: python -m benchmarks.vllm_pd_proxy --port P --prefill URL --decode URL
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# What the prefill server starts from: "do remote decode" (vLLM's NixlConnector fills in the rest).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None,
                  "remote_host": None, "remote_port": None}
# Streaming-only fields a non-streamed prefill request must not carry (vLLM rejects
# stream_options without stream).
_STREAM_ONLY = ("stream", "stream_options")


class HopError(RuntimeError):
    """The prefill hop did not give the decode hop what it needs; ``status`` is the HTTP
    status to answer the client with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def prefill_body(body: dict) -> dict:
    """The prefill server's request for a client's ``/completions`` ``body``: a deep copy,
    non-streamed, ``max_tokens`` 1 (``min_tokens`` dropped, it may exceed 1), with
    :data:`PREFILL_PARAMS` as ``kv_transfer_params``. ``body`` itself is not changed."""
    out = {k: copy.deepcopy(v) for k, v in body.items()
           if k not in _STREAM_ONLY and k != "min_tokens"}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_PARAMS))
    return out


def decode_body(body: dict, prefill_status: int, prefill_json: object) -> dict:
    """The decode server's request: the client's ``body`` with the ``kv_transfer_params``
    of the prefill server's answer (``prefill_status``, its parsed JSON ``prefill_json``).

    Raises:
        HopError: the prefill answer is not 200 (its status, its text in the message), or
            has no ``kv_transfer_params`` object (502: the prefill server is not running a
            KV connector that produces them, e.g. started without ``--kv-transfer-config``).
    """
    if prefill_status != 200:
        raise HopError(prefill_status, f"prefill server answered {prefill_status}: "
                                       f"{str(prefill_json)[:500]}")
    params = prefill_json.get("kv_transfer_params") if isinstance(prefill_json, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise HopError(502, "prefill server's answer has no kv_transfer_params with "
                            f"do_remote_prefill (got {params!r}): is it running NixlConnector "
                            "(--kv-transfer-config with kv_role kv_producer or kv_both)?")
    return {**body, "kv_transfer_params": params}


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error shape with ``message``."""
    return JSONResponse({"error": {"message": message, "type": "proxy_error",
                                   "code": status}}, status_code=status)


def make_app(prefill_url: str, decode_url: str, timeout_s: float = 300.0,
             transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The proxy's ASGI app: ``POST /v1/completions`` (two hops, module docstring) and
    ``GET /v1/models`` (the decode server's). ``prefill_url`` / ``decode_url``: the servers'
    API bases (``http://host:port/v1``); ``timeout_s`` bounds each hop's connect and every
    read (seconds); ``transport``: the upstream clients' transport (tests: a fake one;
    None: TCP)."""
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    clients: dict[str, httpx.AsyncClient] = {}

    def client(base: str) -> httpx.AsyncClient:
        # NOTE: one pooled client per upstream, made in the server's event loop
        if base not in clients:
            clients[base] = httpx.AsyncClient(base_url=base, timeout=timeout,
                                              transport=transport,
                                              limits=httpx.Limits(max_connections=None))
        return clients[base]

    async def models(_: Request) -> Response:
        try:
            resp = await client(decode_url).get("/models")
        except httpx.HTTPError as exc:
            return error_response(502, f"decode server {decode_url}: {type(exc).__name__}: {exc}")
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    async def completions(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as exc:
            return error_response(400, f"request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return error_response(400, "request body is not a JSON object")
        try:
            pre = await client(prefill_url).post("/completions", json=prefill_body(body))
            try:
                pre_json = pre.json()
            except ValueError:
                pre_json = pre.text
            dec = decode_body(body, pre.status_code, pre_json)
        except HopError as exc:
            return error_response(exc.status, str(exc))
        except httpx.TimeoutException as exc:
            return error_response(504, f"prefill server {prefill_url} timed out: {exc!r}")
        except httpx.HTTPError as exc:
            return error_response(502, f"prefill server {prefill_url}: {type(exc).__name__}: {exc}")
        up = client(decode_url)
        try:
            resp = await up.send(up.build_request("POST", "/completions", json=dec), stream=True)
        except httpx.HTTPError as exc:
            return error_response(502, f"decode server {decode_url}: {type(exc).__name__}: {exc}")
        return StreamingResponse(_relay(resp), status_code=resp.status_code,
                                 media_type=resp.headers.get("content-type"))

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            for c in clients.values():
                await c.aclose()

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])],
                     lifespan=lifespan)


async def _relay(resp: httpx.Response) -> AsyncIterator[bytes]:
    """The upstream response's bytes as they come; the upstream stream closed at the end
    (also when the client goes away)."""
    try:
        async for chunk in resp.aiter_bytes():
            yield chunk
    finally:
        await resp.aclose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="prefill server's API base, http://h:p/v1")
    ap.add_argument("--decode", required=True, help="decode server's API base, http://h:p/v1")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per hop read")
    args = ap.parse_args()
    # NOTE: uvicorn binds host:port itself (getaddrinfo's IPPROTO_TCP sockets), so asyncio
    # sets TCP_NODELAY on each accepted connection (docs/performance.md, run 2's cause 1)
    uvicorn.run(make_app(args.prefill, args.decode, args.timeout), host=args.host,
                port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

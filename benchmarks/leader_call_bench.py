"""What a leader call costs over a Ray actor call against a plain TCP socket (issue 36).

Every launch of a request (``Generate``; PD: ``Prefill``, ``Reserve``, ``Attach``, ``Admit``)
is one Ray actor call from the router's event loop to an instance leader. This measures one
such call, the same message both ways, between the same two processes: the caller is an
asyncio loop (as the router), the callee a threaded Ray actor (``max_concurrency`` of the
rank actors) that also serves a TCP socket from a thread of its own (length-prefixed pickle,
TCP_NODELAY both ends, as the token stream's frames).

Per call: ``send->handler`` (the caller's send to the handler starting, ms; one clock:
``time.monotonic`` is system-wide on Linux), ``round trip`` (send to answer, ms), calls of
both kinds alternating; then the caller process's CPU per call (all its threads, Ray's core
worker included), blocks of ``--block`` calls of one kind, alternating. The message is a
``Prefill`` of a 256-token prompt.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/leader_call_bench.py [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import socket
import statistics
import struct
import threading
import time

import ray

from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from orchestrator.deploy.rank_actors import ACTOR_CONCURRENCY
from rank.messages import Prefill

HEADER = "<Q"  # payload length, bytes (a format: a Struct cannot travel with the actor class)
HEADER_SIZE = struct.calcsize(HEADER)


def _serve(conn: socket.socket) -> None:
    """Answer each framed message with the monotonic time it arrived, until EOF."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = conn.makefile("rb")
    while True:
        head = reader.read(HEADER_SIZE)
        if len(head) < HEADER_SIZE:
            return
        pickle.loads(reader.read(struct.unpack(HEADER, head)[0]))
        body = pickle.dumps(time.monotonic())
        conn.sendall(struct.pack(HEADER, len(body)) + body)


@ray.remote(max_concurrency=ACTOR_CONCURRENCY, num_cpus=0)
class Callee:
    """A leader's shape: Ray actor calls on a thread pool, a socket served by a thread."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._accept, daemon=True).start()

    def port(self) -> int:
        return self._server.getsockname()[1]

    def request(self, message: object) -> float:
        """The monotonic time the call's handler started."""
        return time.monotonic()

    def _accept(self) -> None:
        while True:
            conn, _ = self._server.accept()
            threading.Thread(target=_serve, args=(conn,), daemon=True).start()


class SocketCaller:
    """One connection to :class:`Callee`'s socket, one call at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def call(self, message: object) -> float:
        body = pickle.dumps(message)
        self.writer.write(struct.pack(HEADER, len(body)) + body)
        await self.writer.drain()
        head = await self.reader.readexactly(HEADER_SIZE)
        return pickle.loads(await self.reader.readexactly(struct.unpack(HEADER, head)[0]))


def _p(values: list[float], q: float) -> float:
    return sorted(values)[int(q * (len(values) - 1))]


async def run(calls: int, block: int) -> None:
    callee = Callee.remote()
    sock = SocketCaller(*await asyncio.open_connection(
        "127.0.0.1", await callee.port.remote()))
    message = Prefill(RequestSpec("r", tuple(range(256)), SamplingParams(max_tokens=64)), None)
    kinds = {"ray": lambda: callee.request.remote(message), "socket": lambda: sock.call(message)}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for i in range(calls + 10):
        for kind in (("ray", "socket") if i % 2 else ("socket", "ray")):
            sent = time.monotonic()
            started = await kinds[kind]()
            if i >= 10:  # NOTE: the first calls set up connections and workers
                times[kind].append(((started - sent) * 1e3, (time.monotonic() - sent) * 1e3))
            await asyncio.sleep(0.005)
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for b in range(6):
        for kind in (("ray", "socket") if b % 2 else ("socket", "ray")):
            before = time.process_time()
            for _ in range(block):
                await kinds[kind]()
            cpu[kind].append((time.process_time() - before) / block * 1e3)
    for kind, rows in times.items():
        one, both = [r[0] for r in rows], [r[1] for r in rows]
        print(f"{kind:6s} send->handler p50 {statistics.median(one):.3f} p90 {_p(one, 0.9):.3f}"
              f" ms; round trip p50 {statistics.median(both):.3f} p90 {_p(both, 0.9):.3f} ms;"
              f" caller CPU per call p50 {statistics.median(cpu[kind]):.3f} ms")
    ratios = [r[1] / s[1] for r, s in zip(times["ray"], times["socket"])]
    print(f"round trip ray / socket, paired calls: median {statistics.median(ratios):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls of each kind")
    ap.add_argument("--block", type=int, default=50, help="calls per CPU-time block")
    args = ap.parse_args()
    os.environ["RAY_ADDRESS"] = ""  # NOTE: a private Ray, never a cluster this shell joined
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        asyncio.run(run(args.calls, args.block))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

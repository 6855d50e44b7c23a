"""KV pushed layer by layer during the prefill forward vs after the forward (same run).

Two prefill -> decode pairs of rank actors (no Ray; tp1 -> tp1, KV over a gloo pair group:
``same_node="off"``), prefill ranks in this process, each decode rank in a process of its own
(driven over a pipe: its receive and scatter never share this process's interpreter lock with
the prefill forward), one pair with ``TransferConfig.layerwise`` on, one with it off (the
baseline: a chunk's KV is queued after its whole forward), on the tiny model (``--layers``).
Requests alternate between the two pairs, one at a time, ``--reps`` per case:

- one:  a ``--tokens`` prompt (default 2048) in one chunk;
- four: a ``4 x --tokens`` prompt in four chunks.

Per request: ``kv_tail_s`` (decode's own measure: end of the prefill forward of the last chunk
-> every cell on decode), first -> second token (prefill's first-token event to decode's first
event, as the harness sees them), TPOT (decode events after the first) and prefill throughput
(prompt tokens / (Prefill call -> first token)). Reported: medians per mode and the ratio
layerwise / after-forward of each (tail: at most 1/8 expected).

Run: PYTHONPATH=$PWD python benchmarks/layerwise_bench.py [--reps 5] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from decode_worker.role import DecodeRole
from engine.request import RequestSpec
from engine.sampling_params import SamplingParams
from kv_transfer.config import TransferConfig
from orchestrator.tiny_model import write_tiny_checkpoint
from prefill_worker.role import PrefillRole
from rank.config import InstanceConfig, SchedulerConfig
from rank.messages import Admit, Prefill, Reservation, Reserve
from rank.rank import Rank

MODES = ("after", "layerwise")  # TransferConfig.layerwise False / True
BLOCK = 16


def start(ckpt: str, role_cls, role: str, name: str, chunk: int, max_len: int,
          layerwise: bool) -> Rank:
    """A started tp1 rank of ``role`` with room for one ``max_len``-token request."""
    scheduler = SchedulerConfig(block_size=BLOCK, num_kv_blocks=-(-max_len // BLOCK) + 8,
                                chunk_size=chunk, max_num_batched_tokens=chunk, max_num_seqs=2)
    transfer = TransferConfig(same_node="off", layerwise=layerwise)
    cfg = InstanceConfig(name=name, role=role, checkpoint_dir=ckpt, scheduler=scheduler,
                         transfer=transfer)
    rank = Rank(cfg, 0, role_cls)
    rank.start_alone()
    return rank


class RemoteDecode:
    """A decode rank in a spawned process, with the calls the bench makes of a rank."""

    def __init__(self, *start_args) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_decode, args=(child, start_args), daemon=True)
        self._proc.start()
        self._call("ready")

    def _call(self, what: str, *args):
        self._conn.send((what, args))
        if not self._conn.poll(120):
            raise TimeoutError(f"decode process: no answer to {what} within 120 s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"decode process: {what} failed: {value}")
        return value

    def request(self, msg):
        return self._call("request", msg)

    def poll(self, timeout_s: float):
        return self._call("poll", timeout_s)

    def kv_tail(self):
        return self._call("kv_tail")

    def shutdown(self) -> None:
        self._call("stop")
        self._proc.join(30)


def _serve_decode(conn, start_args) -> None:
    torch.set_num_threads(1)
    rank = start(*start_args)
    calls = {"ready": lambda: None, "request": rank.request, "poll": rank.poll,
             "kv_tail": lambda: rank.role.kv_tail}
    try:
        while True:
            what, args = conn.recv()
            if what == "stop":
                conn.send((True, None))
                return
            try:
                conn.send((True, calls[what](*args)))
            except Exception as exc:  # noqa: BLE001 - reported to the bench
                conn.send((False, f"{type(exc).__name__}: {exc}"))
    finally:
        rank.shutdown()


def events_of(rank: Rank, rid: str, stop, timeout_s: float = 120.0) -> list[tuple[float, object]]:
    """(arrival time, event) of ``rid`` until ``stop(event)``; bounded."""
    got, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in rank.poll(0.05):
            if ev.request_id == rid:
                got.append((time.perf_counter(), ev))
                if stop(ev):
                    return got
    raise TimeoutError(f"{rid}: no final event within {timeout_s} s")


def one_request(prefill: Rank, decode: RemoteDecode, rid: str, prompt_len: int,
                output_len: int) -> dict[str, float]:
    """Run one request through the pair; its figures (seconds)."""
    prompt = tuple(1000 + (i * 7919) % 100_000 for i in range(prompt_len))
    spec = RequestSpec(rid, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True))
    res = decode.request(Reserve(spec, 1))
    assert isinstance(res, Reservation), res
    before = decode.kv_tail()
    t0 = time.perf_counter()
    prefill.request(Prefill(spec, res))
    ((t1, first),) = events_of(prefill, rid, lambda e: True)
    assert first.error is None, first.error
    decode.request(Admit(rid, first.token_ids[0]))
    evs = events_of(decode, rid, lambda e: e.finish_reason is not None)
    assert evs[-1][1].error is None, evs[-1][1].error
    t2, t_end = evs[0][0], evs[-1][0]
    n_after = sum(len(e.token_ids) for _, e in evs) - len(evs[0][1].token_ids)
    tail = decode.kv_tail()
    assert tail.count == before.count + 1, "kv_tail_s was not measured"
    return {"tail_s": tail.last_s, "first_second_s": t2 - t1,
            "tpot_s": (t_end - t2) / max(1, n_after), "prefill_tok_s": prompt_len / (t1 - t0)}


def bench(args) -> dict[tuple[str, str], list[dict[str, float]]]:
    """case, mode -> per-request figures."""
    ckpt = str(write_tiny_checkpoint(tempfile.mkdtemp(prefix="lw-bench-"), seed=3,
                                     num_layers=args.layers,
                                     max_position_embeddings=8 * args.tokens))
    max_len = 4 * args.tokens + args.output_len + BLOCK
    pairs = {m: (start(ckpt, PrefillRole, "prefill", f"prefill-{m}", args.tokens, max_len,
                       m == "layerwise"),
                 RemoteDecode(ckpt, DecodeRole, "decode", f"decode-{m}", 1, max_len,
                              m == "layerwise"))
             for m in MODES}
    cases = {"one": args.tokens, "four": 4 * args.tokens}
    out: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for mode in MODES:  # NOTE: pair set-up and first-use costs stay out of the figures
            one_request(*pairs[mode], f"warm-{mode}", args.tokens, args.output_len)
        for rep in range(args.reps):
            for case, n in cases.items():
                for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                    out.setdefault((case, mode), []).append(
                        one_request(*pairs[mode], f"{case}-{mode}-{rep}", n, args.output_len))
    finally:
        for p, d in pairs.values():
            p.shutdown()
            d.shutdown()
    return out


def report(args, out) -> None:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"layerwise_bench {stamp}: tiny model ({args.layers} layers), prefill tp1 -> decode "
          f"tp1 over gloo, {args.reps} requests per line, {args.output_len} output tokens, "
          f"torch threads {torch.get_num_threads()}; medians")
    print("| case | prompt | mode | kv_tail_s ms | kv_tail_s max ms | first->second ms | "
          "TPOT ms | prefill tok/s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    keys = ("tail_s", "first_second_s", "tpot_s", "prefill_tok_s")
    med = {k: {f: statistics.median(r[f] for r in rows) for f in keys}
           for k, rows in out.items()}
    for (case, mode), m in med.items():
        n = args.tokens * (4 if case == "four" else 1)
        worst = max(r["tail_s"] for r in out[(case, mode)])
        print(f"| {case} | {n} | {mode} | {m['tail_s'] * 1e3:.2f} | {worst * 1e3:.2f} | "
              f"{m['first_second_s'] * 1e3:.2f} | {m['tpot_s'] * 1e3:.2f} | "
              f"{m['prefill_tok_s']:.0f} |")
    print("\nratio layerwise / after (tail target <= 0.125):")
    for case in ("one", "four"):
        a, b = med[(case, "after")], med[(case, "layerwise")]
        print(f"  {case}: tail {b['tail_s'] / a['tail_s']:.3f}, first->second "
              f"{b['first_second_s'] / a['first_second_s']:.3f}, TPOT "
              f"{b['tpot_s'] / a['tpot_s']:.3f}, prefill throughput "
              f"{b['prefill_tok_s'] / a['prefill_tok_s']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=2048, help="one chunk's tokens")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--layers", type=int, default=3, help="tiny model layers")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report(args, bench(args))


if __name__ == "__main__":
    main()

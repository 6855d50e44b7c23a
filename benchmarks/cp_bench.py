"""Context-parallel prefill vs TP at 4 ranks: time and peak memory per rank for one long prompt,
and the share of the layer-sharded weight broadcast hidden behind compute (CPU, gloo).

Layouts, each 4 fresh processes of 1 thread: ``TP4`` (heads / MLP / experts split, every rank
all tokens), ``CP4`` (each rank 1/4 of the tokens, all weights replicated), ``CP4+LS`` (CP4
with ``layer_sharding`` of ``--sharded`` attention linears: layer i's stored on rank i % 4 and
broadcast one layer ahead). One ``--tokens`` prompt prefilled in one step; time = best of
``--repeats`` after one warm-up, on the slowest rank; per rank (max over ranks): peak RSS
(``ru_maxrss``, the process's whole peak incl. the Python/torch baseline), the step's peak
(the warm-up step's peak RSS above the RSS before it: activations, scores, gathers) and the
weight bytes (parameters + the prefetch pool). Overlap (CP4+LS): ``1 - wait / broadcast``, where
``wait`` is the time a forward spent blocked on the weight broadcasts (``prefetcher.stats``)
and ``broadcast`` the time of the same broadcasts with no compute in between; mean over ranks.
Random tiny-architecture weights, wider (``--hidden``, ``--heads``, ``--q-lora``), fp32.
Not a test; run: ``PYTHONPATH=. python benchmarks/cp_bench.py`` (a few minutes).
"""

from __future__ import annotations

import argparse
import resource
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from engine.parallel import init_cp_group, init_tp_group
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint

BLOCK = 64
LAYOUTS = ("TP4", "CP4", "CP4+LS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runner(layout: str, index: int, port: int, ckpt: str, args) -> tuple[ModelRunner, object]:
    blocks = -(-args.tokens // BLOCK)
    if layout == "TP4":
        group = init_tp_group(index, 4, "127.0.0.1", port, timeout_s=300)
        return ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK, tp=group), group
    group = init_cp_group(index, 4, "127.0.0.1", port, timeout_s=300)
    sharded = tuple(args.sharded) if layout == "CP4+LS" else ()
    return ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK, cp=group,
                       layer_sharding=sharded), group


def _broadcast_only(runner: ModelRunner) -> float:
    """Seconds of one forward's weight broadcasts with no compute in between."""
    pf, start = runner.prefetcher, time.perf_counter()
    pf.begin()
    for i in range(runner.model_config.num_hidden_layers):
        pf.before_layer(i)
        pf.after_layer(i)
    return time.perf_counter() - start


def _rss_kib() -> int:
    """This process's resident memory now, KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def _rank_main(index: int, layout: str, port: int, ckpt: str, args, out: str) -> None:
    torch.set_num_threads(1)
    runner, group = _runner(layout, index, port, ckpt, args)
    try:
        ids = tuple(torch.randint(2, 1000, (args.tokens,),
                                  generator=torch.Generator().manual_seed(0)).tolist())
        step = [SeqStep("p", ids, 0, tuple(range(-(-args.tokens // BLOCK))))]
        before = _rss_kib()
        runner.execute(step)  # warm-up; its peak is the step's
        step_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        times, waits, bcasts = [], [], []
        for _ in range(args.repeats):
            if runner.prefetcher is not None:
                bcasts.append(_broadcast_only(runner))
                runner.prefetcher.stats.wait_s = 0.0
            start = time.perf_counter()
            runner.execute(step)
            times.append(time.perf_counter() - start)
            if runner.prefetcher is not None:
                waits.append(runner.prefetcher.stats.wait_s)
        pool = runner.prefetcher.pool_bytes if runner.prefetcher is not None else 0
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters()) + pool
        torch.save({"s": min(times), "weights": weights, "wait": waits, "bcast": bcasts,
                    "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                    "step_kib": step_peak},
                   f"{out}/{index}.pt")
    finally:
        group.destroy()


def run_layout(layout: str, ckpt: str, args) -> list[dict]:
    """Every rank's results of one layout (4 fresh processes)."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank_main, args=(layout, _free_port(), ckpt, args, out), nprocs=4,
                           join=True, start_method="spawn")
        return [torch.load(f"{out}/{i}.pt") for i in range(4)]


def _overlap(ranks: list[dict]) -> str:
    if not ranks[0]["bcast"]:
        return "-"
    fractions = [1 - min(1.0, min(r["wait"]) / max(min(r["bcast"]), 1e-9)) for r in ranks]
    return f"{statistics.mean(fractions):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--q-lora", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sharded", nargs="+", default=["q_b_proj", "kv_b_proj", "o_proj"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(write_tiny_checkpoint(
            tmp, hidden_size=args.hidden, num_heads=args.heads, q_lora_rank=args.q_lora,
            num_layers=args.layers, vocab_size=1024, max_position_embeddings=2 * args.tokens))
        print(f"{args.tokens}-token prefill, 4 ranks, hidden {args.hidden}, {args.heads} heads, "
              f"q_lora {args.q_lora}, {args.layers} layers, fp32; LS = {args.sharded}")
        print(f"{'layout':<8}{'prefill s':>10}{'peak RSS MiB':>14}{'step peak MiB':>15}"
              f"{'weights MiB':>13}{'overlap':>9}")
        for layout in LAYOUTS:
            ranks = run_layout(layout, ckpt, args)
            print(f"{layout:<8}{max(r['s'] for r in ranks):>10.2f}"
                  f"{max(r['peak_kib'] for r in ranks) / 1024:>14.0f}"
                  f"{max(r['step_kib'] for r in ranks) / 1024:>15.0f}"
                  f"{max(r['weights'] for r in ranks) / 2**20:>13.2f}{_overlap(ranks):>9}")


if __name__ == "__main__":
    main()

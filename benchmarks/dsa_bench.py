"""DeepSeek-V3 dense MLA vs DeepSeek-V3.2 sparse attention (DSA): time vs context length (CPU).

Two tiny checkpoints with the same dims (8 heads, hidden 64, 3 layers); the V3.2 one adds a
lightning indexer of 4 heads x 16 dims (indexer MACs per key about 0.2x MLA's, as in the real
model: 64 x 128 vs 128 x (192 + 128)) keeping ``--topk`` tokens per query. V3.2 runs twice:
with the ``sparse_prefill`` kernel's default MHA form and with its ``absorbed`` variant.

For each context length L: the prefill time of one L-token prompt (one ``execute``), and the
time of one decode step of ``--decode-batch`` sequences each at context L (the cache is not
filled first: a step's cost does not depend on the cached values). Best of a few runs; then
the least-squares slopes in ms per 1K tokens of context. Past index_topk the sparse decode
step grows only with the indexer's scan of the index_k cache (MLA reads topk entries).
Not a test; run: ``PYTHONPATH=. python benchmarks/dsa_bench.py`` (several minutes, 1 thread).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from timing import best_time  # benchmarks/timing.py (scripts run as files)

BLOCK = 64
DIMS = {"num_heads": 8, "num_layers": 3, "seed": 0, "max_position_embeddings": 32768}


def measure(runner: ModelRunner, n: int, batch: int, repeats: int,
            decode_repeats: int) -> tuple[float, float]:
    """(prefill ms of an n-token prompt, ms of a decode step of ``batch`` seqs at context n)."""
    ids = torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    per_seq = -(-(n + 1) // BLOCK)
    tables = [tuple(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    prefill = 1e3 * best_time(
        lambda: runner.execute([SeqStep("p", tuple(ids), 0, tables[0])]), repeats)
    step = [SeqStep(str(b), (7,), n, tables[b]) for b in range(batch)]
    decode = 1e3 * best_time(lambda: runner.execute(step), decode_repeats)
    return prefill, decode


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs, per 1K of x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return 1e3 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) \
        / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--decode-repeats", type=int, default=10)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = args.decode_batch * -(-(max(args.contexts) + 1) // BLOCK)
    v32 = {"deepseek_v32": True, "index_topk": args.topk, "index_n_heads": 4,
           "index_head_dim": 16}
    cases = (("V3 dense", {}, None), ("V3.2 sparse, mha prefill", v32, "mha"),
             ("V3.2 sparse, absorbed prefill", v32, "absorbed"))
    results: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra, variant in cases:
            ckpt = write_tiny_checkpoint(Path(tmp) / name.split()[0], **DIMS, **extra)
            choices = {"sparse_prefill": variant} if variant else None
            runner = ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK,
                                 kernel_choices=choices)
            results[name] = []
            for n in args.contexts:
                results[name].append(measure(runner, n, args.decode_batch, args.repeats,
                                             args.decode_repeats))
                print(f"{name} {n}: prefill, decode ms {results[name][-1]}", flush=True)
    print(f"threads {args.threads}, index_topk {args.topk}, decode batch {args.decode_batch}")
    print(f"{'context':>8} {'case':>30} {'prefill ms':>11} {'decode ms':>10}")
    for name, rows in results.items():
        for n, (pre, dec) in zip(args.contexts, rows):
            print(f"{n:>8} {name:>30} {pre:>11.1f} {dec:>10.2f}")
    for name, rows in results.items():
        print(f"{name}: prefill slope {slope(args.contexts, [r[0] for r in rows]):.0f} ms/1K "
              f"tokens, decode slope {slope(args.contexts, [r[1] for r in rows]):.2f} ms/1K")


if __name__ == "__main__":
    main()

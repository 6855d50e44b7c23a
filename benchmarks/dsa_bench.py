"""DeepSeek-V3 dense MLA vs DeepSeek-V3.2 sparse attention (DSA): time vs context length (CPU).

Two tiny checkpoints with the same dims (8 heads, hidden 64, 3 layers); the V3.2 one adds a
lightning indexer of 4 heads x 16 dims (indexer MACs per key about 0.2x MLA's, as in the real
model: 64 x 128 vs 128 x (192 + 128)) keeping ``--topk`` tokens per query. For each context
length L: prefill time of an L-token prompt (one ``execute``) and the time of one decode step
(batch 1) after it, best of a few runs. Prints the table and the least-squares slopes (ms per
1K tokens of context). Past index_topk the sparse decode step grows only with the indexer's
scan of the index_k cache; the MLA part stays at topk entries. Not a test; run:
``PYTHONPATH=. python benchmarks/dsa_bench.py`` (about 2 minutes, 1 thread).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint

BLOCK = 64
DIMS = {"num_heads": 8, "num_layers": 3, "seed": 0}


def _best(fn, repeats: int) -> float:
    """Best wall time of ``repeats`` calls in ms (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def measure(runner: ModelRunner, n: int, repeats: int) -> tuple[float, float]:
    """(prefill ms of an n-token prompt, decode-step ms at context n)."""
    ids = torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    table = tuple(range(-(-(n + 1) // BLOCK)))
    prefill = _best(lambda: runner.execute([SeqStep("p", tuple(ids), 0, table)]), repeats)
    decode = _best(lambda: runner.execute([SeqStep("p", (7,), n, table)]), 2 * repeats)
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
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    blocks = -(-(max(args.contexts) + 1) // BLOCK)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("V3 dense", {}),
                            ("V3.2 sparse", {"deepseek_v32": True, "index_topk": args.topk,
                                             "index_n_heads": 4, "index_head_dim": 16})):
            ckpt = write_tiny_checkpoint(Path(tmp) / name.split()[0], **DIMS, **extra)
            runner = ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK)
            results[name] = [measure(runner, n, args.repeats) for n in args.contexts]
    print(f"threads {args.threads}, index_topk {args.topk}; ms (best of {args.repeats})")
    print(f"{'context':>8} " + " ".join(f"{n + ' ' + k:>22}" for n in results
                                        for k in ("prefill", "decode")))
    for i, n in enumerate(args.contexts):
        print(f"{n:>8} " + " ".join(f"{results[name][i][j]:>22.2f}" for name in results
                                    for j in (0, 1)))
    for name, rows in results.items():
        print(f"{name}: prefill slope {slope(args.contexts, [r[0] for r in rows]):.1f} ms/1K "
              f"tokens, decode slope {slope(args.contexts, [r[1] for r in rows]):.3f} ms/1K")


if __name__ == "__main__":
    main()

"""Graph mode vs eager: decode step time of the tiny model at batch 1, 8, 32 (CPU).

Two runners on the same checkpoint in one process, one eager and one with graph mode (the
"compile" backend: torch.compile, inductor) and buckets equal to the batches. Per batch: a
64-token prompt per sequence on both, then decode steps of one token per sequence; the
figure is the best of ``--steps`` steps (benchmarks/timing.py) after the capturing step,
whose time (compile time of the bucket) is printed too. After the timed steps, one more
step on both checks the graph runner's logits against eager's (max |diff| printed). Not a test; run:
``PYTHONPATH=. TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/graph_bench.py``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from engine.graph import GraphConfig
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from timing import best_time  # benchmarks/timing.py (scripts run as files)

BLOCK, PROMPT = 16, 64


def _steps(batch: int, pos: int, blocks_per: int, prompt: bool) -> list[SeqStep]:
    """One decode token per sequence at position ``pos`` (or the whole prompt)."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, 129280, (batch, PROMPT), generator=gen).tolist()
    tables = [tuple(range(b * blocks_per, (b + 1) * blocks_per)) for b in range(batch)]
    if prompt:
        return [SeqStep(str(b), tuple(ids[b]), 0, tables[b]) for b in range(batch)]
    return [SeqStep(str(b), (7,), pos, tables[b]) for b in range(batch)]


def _time_decode(runner: ModelRunner, batch: int, blocks_per: int, steps: int) -> float:
    """Best decode step time (s) of ``runner`` over positions PROMPT, PROMPT + 1, ..."""
    pos = [PROMPT]

    def one() -> None:
        runner.execute(_steps(batch, pos[0], blocks_per, prompt=False))
        pos[0] += 1

    return best_time(one, steps)


def bench(ckpt: str, batches: list[int], steps: int) -> list[tuple[int, float, float, float,
                                                                  float]]:
    """Per batch: (batch, eager step s, graph step s, capture s, max |logit diff|)."""
    blocks_per = -(-(PROMPT + steps + 4) // BLOCK)
    blocks = max(batches) * blocks_per
    eager = ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK)
    graph = ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK,
                        graph=GraphConfig(enabled=True, batch_sizes=tuple(batches)))
    rows = []
    for batch in batches:
        for r in (eager, graph):
            r.execute(_steps(batch, 0, blocks_per, prompt=True))
        graph.execute(_steps(batch, PROMPT, blocks_per, prompt=False))  # captures
        t_eager, t_graph = (_time_decode(r, batch, blocks_per, steps) for r in (eager, graph))
        check = _steps(batch, PROMPT + steps + 1, blocks_per, prompt=False)
        diff = (graph.execute(check) - eager.execute(check)).abs().max().item()
        rows.append((batch, t_eager, t_graph, graph.graphs.capture_s[batch], diff))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dense-layers", type=int, default=1,
                        help="first_k_dense_replace (= --layers: no MoE layer)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(write_tiny_checkpoint(tmp, seed=0, num_layers=args.layers,
                                         first_k_dense_replace=args.dense_layers))
        rows = bench(ckpt, args.batches, args.steps)
    print(f"tiny model, {args.layers} layers ({args.dense_layers} dense), context {PROMPT}, "
          f"{args.threads} thread(s), best of {args.steps}")
    print("batch | eager step ms | graph step ms | graph/eager | capture s | max |diff|")
    for batch, t_e, t_g, cap, diff in rows:
        print(f"{batch:5d} | {t_e * 1e3:13.2f} | {t_g * 1e3:13.2f} | {t_g / t_e:11.2f} | "
              f"{cap:9.1f} | {diff:.1e}")


if __name__ == "__main__":
    main()

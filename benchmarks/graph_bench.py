"""Graph mode vs eager: decode step time of the tiny model at batch 1, 8, 32 (CPU).

Two runners on the same checkpoint in one process, one eager and one with graph mode (the
"compile" backend: torch.compile, inductor) and buckets equal to the batches. Per batch: a
64-token prompt per sequence on both, then decode steps of one token per sequence
(context 64 to 79); the figure is the best step of ``--rounds`` alternating rounds of
``--steps`` steps per runner (benchmarks/timing.py) after the capturing step, whose time
(compile time of the bucket) is printed too. After the timed steps, one more step on both
checks the graph runner's logits against eager's (max |diff| printed). With
``--speculative K`` both runners speculate (the checkpoint gets an MTP module): each step
drafts K tokens per sequence (from a fixed hidden state) and verifies them, the graph
runner through its verify and draft buckets of ``batch * (1 + K)`` tokens.
``--thread-time`` times on this thread's CPU clock instead of the wall clock, and the
per-round graph / eager ratios (paired: each round times both) are printed as median
[range]. ``--linear-lm-head`` adds a third runner, graph mode with the lm_head kernel
"torch" (``F.linear`` traced into the graph, as graph mode ran before the packed oneDNN
GEMM became an op of the capture). Not a test; run:
``PYTHONPATH=. TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/graph_bench.py``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from engine.graph import GraphConfig
from engine.runner import ModelRunner, SeqStep
from engine.spec_decode import DraftInput, SpecOutput
from orchestrator.tiny_model import write_tiny_checkpoint
from timing import best_time  # benchmarks/timing.py (scripts run as files)

BLOCK, PROMPT, WINDOW = 16, 64, 16
HIDDEN = 64  # the tiny checkpoint's hidden_size (the drafts' fixed hidden state)


def _steps(batch: int, pos: int, blocks_per: int, prompt: bool, k: int = 0
           ) -> list[SeqStep]:
    """One decode token per sequence at position ``pos`` (or the whole prompt); with ``k``
    drafts each from a fixed hidden state at ``pos - 1``."""
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(2, 129280, (batch, PROMPT), generator=gen).tolist()
    tables = [tuple(range(b * blocks_per, (b + 1) * blocks_per)) for b in range(batch)]
    if prompt:
        return [SeqStep(str(b), tuple(ids[b]), 0, tables[b]) for b in range(batch)]
    draft = DraftInput(torch.randn(1, HIDDEN, generator=gen), pos - 1, (7,)) if k else None
    return [SeqStep(str(b), (7,), pos, tables[b], draft=draft, num_drafts=k)
            for b in range(batch)]


def _stepper(runner: ModelRunner, batch: int, blocks_per: int, k: int):
    """One decode step of ``runner`` per call, positions cycling over PROMPT .. PROMPT +
    WINDOW - 1 (token 7 everywhere, so every runner's cache ends up identical)."""
    calls = [0]

    def one() -> None:
        runner.execute(_steps(batch, PROMPT + calls[0] % WINDOW, blocks_per, False, k))
        calls[0] += 1

    return one


def _logits(out) -> torch.Tensor:
    return out.logits if isinstance(out, SpecOutput) else out


def bench(ckpt: str, batches: list[int], steps: int, rounds: int, k: int = 0,
          linear: bool = False, clock=time.perf_counter) -> list[dict]:
    """Per batch: {"batch", "eager", "graph"[, "graph_linear"]: best step s, "ratios":
    {"graph"[, "graph_linear"]: per-round ratio to eager}, "capture": s, "diff": max |logit
    diff| graph vs eager}; ``k``:
    speculative decoding with k drafts (capture s: the verify bucket's); ``linear``: also a
    graph runner whose lm_head is ``F.linear``."""
    blocks_per = -(-(PROMPT + WINDOW + 1 + k) // BLOCK)
    blocks = max(batches) * blocks_per
    graph = GraphConfig(enabled=True, batch_sizes=tuple(batches))
    runners = {"eager": ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK,
                                    num_speculative_tokens=k),
               "graph": ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK,
                                    num_speculative_tokens=k, graph=graph)}
    if linear:
        runners["graph_linear"] = ModelRunner(ckpt, num_kv_blocks=blocks, block_size=BLOCK,
                                              num_speculative_tokens=k, graph=graph,
                                              kernel_choices={"lm_head": "torch"})
    rows = []
    for batch in batches:
        for r in runners.values():
            r.execute(_steps(batch, 0, blocks_per, prompt=True))
        for name, r in runners.items():
            if name != "eager":
                r.execute(_steps(batch, PROMPT, blocks_per, False, k))  # captures
        runs = {name: _stepper(r, batch, blocks_per, k) for name, r in runners.items()}
        best = {name: float("inf") for name in runners}
        ratios = {name: [] for name in runners if name != "eager"}
        for _ in range(rounds):  # NOTE: alternating rounds: load changes hit both alike
            this = {name: best_time(run, steps, clock) for name, run in runs.items()}
            best = {name: min(best[name], this[name]) for name in runners}
            for name, per_round in ratios.items():
                per_round.append(this[name] / this["eager"])
        check = _steps(batch, PROMPT + WINDOW, blocks_per, False, k)
        want = _logits(runners["eager"].execute(check))
        diff = (_logits(runners["graph"].execute(check)) - want).abs().max()
        # NOTE: a bucket whose capture failed runs eager (capture time reported as nan)
        capture = runners["graph"].graphs.capture_s.get(batch * (1 + k), float("nan"))
        rows.append({"batch": batch, **best, "ratios": ratios, "capture": capture,
                     "diff": diff.item()})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--dense-layers", type=int, default=1,
                        help="first_k_dense_replace (= --layers: no MoE layer)")
    parser.add_argument("--speculative", type=int, default=0,
                        help="K > 0: MTP speculative decoding with K drafts per step")
    parser.add_argument("--thread-time", action="store_true",
                        help="time on this thread's CPU clock (default: wall)")
    parser.add_argument("--linear-lm-head", action="store_true",
                        help="also graph mode with lm_head F.linear (kernel 'torch')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = str(write_tiny_checkpoint(tmp, seed=0, num_layers=args.layers,
                                         first_k_dense_replace=args.dense_layers,
                                         mtp_layers=int(args.speculative > 0)))
        clock = time.thread_time if args.thread_time else time.perf_counter
        rows = bench(ckpt, args.batches, args.steps, args.rounds, args.speculative,
                     args.linear_lm_head, clock)
    print(f"tiny model, {args.layers} layers ({args.dense_layers} dense), context {PROMPT}, "
          f"{args.threads} thread(s), best of {args.rounds} x {args.steps} steps, "
          f"{args.speculative} MTP drafts, {'thread CPU' if args.thread_time else 'wall'} ms")
    print("batch | eager step | graph step | graph/eager: best, per round median [range] "
          "| capture s | max |diff|" + (" | graph, F.linear lm_head: step, /eager per round"
                                         if args.linear_lm_head else ""))
    for row in rows:  # capture nan: the bucket fell back to eager
        extra = f" | {row['graph_linear'] * 1e3:.2f}, {_spread(row['ratios']['graph_linear'])}" \
            if "graph_linear" in row else ""
        print(f"{row['batch']:5d} | {row['eager'] * 1e3:.2f} | {row['graph'] * 1e3:.2f} | "
              f"{row['graph'] / row['eager']:.2f}, {_spread(row['ratios']['graph'])} | "
              f"{row['capture']:.1f} | {row['diff']:.1e}{extra}")


def _spread(values: list[float]) -> str:
    """``median [min-max]``."""
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


if __name__ == "__main__":
    main()

"""Model-runtime throughput vs HF transformers on the same random DeepSeek-V3 weights (CPU).

Prefill: tokens/s of one prompt of 512 and 2048 tokens (ours: one ``execute``; HF: one
forward with ``logits_to_keep=1``, no cache). Decode: tokens/s at batch 1, 8, 32 after a
64-token prompt per sequence, from the fastest step after 2 warm-up steps (ours: one
``execute`` per step over the batch; HF: forward of one token per sequence with its
DynamicCache, as ``generate`` does). Prints a table with
ours/HF ratios. Not a test; run: ``PYTHONPATH=. python benchmarks/engine_bench.py``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from timing import best_time  # benchmarks/timing.py (scripts run as files)

BLOCK = 16
PROMPT_DECODE = 64


def _prompts(batch: int, n: int) -> torch.Tensor:
    return torch.randint(2, 129280, (batch, n), generator=torch.Generator().manual_seed(batch))


def bench_prefill(runner: ModelRunner, hf, n: int) -> tuple[float, float]:
    ids = _prompts(1, n)
    step = [SeqStep("p", tuple(ids[0].tolist()), 0, tuple(range(-(-n // BLOCK))))]
    ours = best_time(lambda: runner.execute(step), 3)
    with torch.inference_mode():
        ref = best_time(lambda: hf(ids, use_cache=False, logits_to_keep=1), 3)
    return n / ours, n / ref


def _best_rate(batch: int, step_fn, steps: int) -> float:
    """Tokens/s from the fastest of ``steps`` steps after 2 warm-up steps (best-of is the
    figure least disturbed by other processes on a shared machine)."""
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        step_fn(i)
        times.append(time.perf_counter() - t0)
    return batch / min(times[2:])


def _ours_decode(runner: ModelRunner, ids: torch.Tensor, steps: int) -> float:
    batch, blocks_per = ids.shape[0], -(-(PROMPT_DECODE + steps + 3) // BLOCK)
    tables = [tuple(range(b * blocks_per, (b + 1) * blocks_per)) for b in range(batch)]
    runner.execute([SeqStep(str(b), tuple(ids[b].tolist()), 0, tables[b]) for b in range(batch)])
    return _best_rate(batch, lambda i: runner.execute(
        [SeqStep(str(b), (7,), PROMPT_DECODE + i, tables[b]) for b in range(batch)]), steps)


@torch.inference_mode()
def _hf_decode(hf, ids: torch.Tensor, steps: int) -> float:
    cache = hf(ids, use_cache=True, logits_to_keep=1).past_key_values
    tok = torch.full((ids.shape[0], 1), 7)
    return _best_rate(ids.shape[0], lambda i: hf(tok, past_key_values=cache, use_cache=True),
                        steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--decode-steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DeepseekV3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(tmp, seed=0, hidden_size=256, num_heads=8,
                                     kv_lora_rank=64, n_routed_experts=16, num_layers=4)
        hf = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        runner = ModelRunner(ckpt, num_kv_blocks=32 * 8 + 8, block_size=BLOCK)
        rows = _run_all(runner, hf, args.decode_steps)
    print(f"checkpoint: hidden 256, 8 heads, kv_lora 64, 4 layers (1 dense, 3 MoE x 16 "
          f"experts), fp32, {args.threads} threads, torch {torch.__version__}")
    print(f"{'case':<18}{'orch tok/s':>12}{'HF tok/s':>12}{'ratio':>8}")
    for name, ours, ref in rows:
        print(f"{name:<18}{ours:>12.1f}{ref:>12.1f}{ours / ref:>8.2f}")


def _run_all(runner: ModelRunner, hf, decode_steps: int) -> list[tuple[str, float, float]]:
    rows = [(f"prefill {n} tok", *bench_prefill(runner, hf, n)) for n in (512, 2048)]
    for batch in (1, 8, 32):
        ids = _prompts(batch, PROMPT_DECODE)
        rows.append((f"decode batch {batch}", _ours_decode(runner, ids, decode_steps),
                     _hf_decode(hf, ids, decode_steps)))
    return rows

if __name__ == "__main__":
    main()

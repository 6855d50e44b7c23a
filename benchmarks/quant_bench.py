"""Quantized weights on CPU: expert MLP time, weight bytes per rank, accuracy on the tiny model.

1. Expert MLP time (DeepSeek-V3 expert: hidden 7168, intermediate 2048) for T tokens: fp32
   and bf16 SwiGLU (three ``F.linear``) vs the int8 fused ``w8a8_mlp`` kernel (torch
   reference: ``torch._int_mm``), best of N after a warm-up, one thread.
2. Weight bytes per rank of DeepSeek-V3 (61 layers, no MTP) on the A3 layout (prefill dp2 x
   tp16, decode dp8 x tp4, EP 32 on both sides: 8 whole routed experts per rank, attention /
   dense / shared MLP split by tp, embedding and lm_head vocab-parallel): bf16 vs FP8 block
   (``fp8_storage: fp8``) vs W8A8, counted with :func:`engine.quant.memory.stored_weight_bytes`
   (what the memory plan calls).
3. Accuracy on the tiny model (fp32 compute): 16 prompts, cosine of last-token logits vs the
   fp32 checkpoint, and the share of identical greedy tokens over 16 steps teacher-forced on
   the fp32 model's greedy continuation.

Not a test; run: ``PYTHONPATH=. python benchmarks/quant_bench.py``.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.quant import w8a8
from engine.quant.formats import FP8_BLOCK, W8A8_INT8, QuantScheme
from engine.quant.memory import stored_weight_bytes
from engine.quant.writer import quantize_checkpoint
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from timing import best_time  # benchmarks/timing.py (scripts run as files)

V3 = dict(hidden=7168, layers=61, heads=128, q_lora=1536, kv_lora=512, nope=128, rope=64,
          v=128, experts=256, inter=18432, moe_inter=2048, vocab=129280, dense_layers=3)


def mlp_times(tokens: list[int], repeats: int) -> list[tuple[int, float, float, float]]:
    """(T, fp32 ms, bf16 ms, int8 ms) of one expert MLP call."""
    h, i = V3["hidden"], V3["moe_inter"]
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(2 * i, h, generator=gen) / h**0.5, \
        torch.randn(h, i, generator=gen) / i**0.5
    gu_q, gu_s = w8a8.quantize_per_channel(gate_up)
    d_q, d_s = w8a8.quantize_per_channel(down)
    rows = []
    for t in tokens:
        x = torch.randn(t, h, generator=gen)
        times = []
        for dtype in (torch.float32, torch.bfloat16):
            xd, gud, dd = x.to(dtype), gate_up.to(dtype), down.to(dtype)

            def ref(xd=xd, gud=gud, dd=dd):
                g, u = F.linear(xd, gud).chunk(2, dim=-1)
                return F.linear(F.silu(g) * u, dd)
            times.append(best_time(ref, repeats) * 1e3)
        times.append(best_time(lambda: w8a8.w8a8_mlp(x, gu_q, gu_s, d_q, d_s), repeats) * 1e3)
        rows.append((t, *times))
    return rows


def rank_weights(tp: int, ep: int) -> Iterator[tuple[str, tuple[int, ...], int]]:
    """(checkpoint name, local shape, how many such tensors) of one rank of DeepSeek-V3."""
    c, heads = V3, V3["heads"] // tp
    hid, lay, moe = c["hidden"], c["layers"], c["layers"] - c["dense_layers"]
    attn = {"q_a_proj": (c["q_lora"], hid), "q_b_proj": (heads * (c["nope"] + c["rope"]),
                                                         c["q_lora"]),
            "kv_a_proj_with_mqa": (c["kv_lora"] + c["rope"], hid),
            "kv_b_proj": (heads * (c["nope"] + c["v"]), c["kv_lora"]),
            "o_proj": (hid, heads * c["v"])}
    for proj, shape in attn.items():
        yield f"model.layers.0.self_attn.{proj}.weight", shape, lay
    yield "model.layers.0.input_layernorm.weight", (hid,), 4 * lay  # 4 norms, ~hidden each
    for prefix, inter, n in (("mlp", c["inter"] // tp, c["dense_layers"]),
                             ("mlp.shared_experts", c["moe_inter"] // tp, moe),
                             ("mlp.experts.0", c["moe_inter"], moe * c["experts"] // ep)):
        for proj, shape in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)),
                            ("down_proj", (hid, inter))):
            yield f"model.layers.3.{prefix}.{proj}.weight", shape, n
    yield "model.layers.3.mlp.gate.weight", (c["experts"], hid), moe
    yield "model.embed_tokens.weight", (c["vocab"] // tp, hid), 1
    yield "lm_head.weight", (c["vocab"] // tp, hid), 1


def weight_table() -> list[tuple[str, float, float, float]]:
    """(role, bf16 GB, FP8 GB, W8A8 GB) of weights per rank on the A3 layout (GB = 10^9 bytes,
    the memory plan's unit)."""
    schemes = [(None, "dequantize"), (QuantScheme(FP8_BLOCK, (128, 128)), "fp8"),
               (QuantScheme(W8A8_INT8), "dequantize")]
    rows = []
    for role, tp in (("prefill dp2 x tp16, ep32", 16), ("decode dp8 x tp4, ep32", 4)):
        gib = [sum(stored_weight_bytes(n, s, q, 2, st) * k for n, s, k in rank_weights(tp, 32))
               / 1e9 for q, st in schemes]
        rows.append((role, *gib))
    return rows


PROMPTS = [torch.randint(2, 129280, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in range(9, 41, 2)]


def _greedy_agreement(ref: ModelRunner, other: ModelRunner, steps: int) -> tuple[float, ...]:
    """(min cosine, mean cosine, identical greedy share) of ``other`` vs ``ref``."""
    blocks = [tuple(range(4 * i, 4 * i + 4)) for i in range(len(PROMPTS))]
    run = [SeqStep(f"r{i}", tuple(p), 0, blocks[i]) for i, p in enumerate(PROMPTS)]
    a, b = ref.execute(run), other.execute(run)
    cos = F.cosine_similarity(a, b, dim=-1)
    same, total = 0, 0
    for _ in range(steps):
        tokens = a.argmax(-1)
        same += int((b.argmax(-1) == tokens).sum())
        total += len(tokens)
        run = [SeqStep(s.request_id, (int(t),), s.num_computed_tokens + len(s.token_ids),
                       s.block_ids) for s, t in zip(run, tokens)]
        a, b = ref.execute(run), other.execute(run)
    return float(cos.min()), float(cos.mean()), same / total


def accuracy_table(steps: int) -> list[tuple[str, float, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        ref = ModelRunner(tiny, num_kv_blocks=70, block_size=16)
        rows = []
        for scheme, storage in (("fp8-block", "fp8"), ("w8a8", "dequantize")):
            ckpt = quantize_checkpoint(tiny, Path(tmp) / scheme, scheme)
            other = ModelRunner(ckpt, num_kv_blocks=70, block_size=16, fp8_storage=storage)
            rows.append((scheme, *_greedy_agreement(ref, other, steps)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("expert MLP (7168 x 2048), 1 thread, best ms:\n  T     fp32     bf16   int8 fused")
    for t, f32, bf16, i8 in mlp_times(args.tokens, args.repeats):
        print(f"{t:4d} {f32:8.2f} {bf16:8.2f} {i8:8.2f}   int8/fp32 {i8 / f32:.2f}")
    print("\nDeepSeek-V3 weights per rank, A3 layout (GB):   bf16    FP8   W8A8")
    for role, bf16, fp8, i8 in weight_table():
        print(f"  {role:28s} {bf16:6.2f} {fp8:6.2f} {i8:6.2f}")
    print(f"\ntiny model vs fp32, 16 prompts, {args.steps} greedy steps teacher-forced:")
    for scheme, cmin, cmean, share in accuracy_table(args.steps):
        print(f"  {scheme:10s} cosine min {cmin:.4f} mean {cmean:.4f}  identical greedy "
              f"{share:.3f}")


if __name__ == "__main__":
    main()

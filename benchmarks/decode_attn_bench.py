"""Paged decode attention: peak extra memory and time of the tiled block-table read vs the old
padded gather, side by side in one run (CPU).

Part 1, one layer's ``mla_decode`` at DeepSeek-V3 dims per rank (16 heads: 128 heads at tp 8;
kv_lora_rank 512, rope 64, nope 128, v 128), ``--batch`` sequences at ``--context`` tokens in
blocks of ``--block-size`` spread over a shuffled cache: ``decode_absorbed`` (tiled, the
default kernel) against the padded-copy path it replaced (``attend_selected_absorbed`` over
``DecodeBatch.padded_slots``, the old ``[B, S, L + R]`` gather) and the analytic padded size
``B * S * (L + R) * bytes``. Part 2, one whole decode step of a tiny model (``execute``) with
the tiled kernel and with the padded path registered as a bench-only variant, and the time
of the step's ``build_attention_metadata``.

Peak extra memory: torch.profiler (``profile_memory=True``) allocation and free events of
the call, summed in time order, the maximum of the running total (CPU has no allocator peak
counter; tracemalloc does not see torch's allocations). Time: best of ``--repeats``.
Not a test; run: ``PYTHONPATH=. python benchmarks/decode_attn_bench.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from engine.forward_context import BlockTableCache, DecodeBatch, build_attention_metadata
from engine.kernels import KERNELS
from engine.mla_ops import attend_selected_absorbed, decode_absorbed
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from timing import best_time  # benchmarks/timing.py (scripts run as files)

H, P, R, V, L = 16, 128, 64, 128, 512  # DeepSeek-V3 MLA dims of one tp-8 rank
MIB = 1024 * 1024


def padded_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, batch: DecodeBatch, w_uk: torch.Tensor,
                  w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """The decode path before paging: absorbed attention over a padded ``[B, S, L + R]`` copy."""
    return attend_selected_absorbed(q_nope, q_pe, k_cache, v_cache,
                                    batch.padded_slots(k_cache.shape[1]), w_uk, w_uv, scale)


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """Peak of the bytes ``fn`` holds allocated at once (profiler memory events in time
    order; an op's own allocations count at its start, frees at their own events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def decode_case(batch: int, context: int, block_size: int, dtype: torch.dtype):
    """Inputs of one layer's decode: caches of exactly the batch's blocks, shuffled."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-(context + 1) // block_size)
    blocks = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).tolist()
    meta = build_attention_metadata([1] * batch, [context] * batch,
                                    [tuple(b) for b in blocks], block_size)
    k_cache = torch.randn(batch * per_seq, block_size, L, generator=gen).to(dtype)
    v_cache = torch.randn(batch * per_seq, block_size, R, generator=gen).to(dtype)
    q_nope = torch.randn(batch, H, P, generator=gen).to(dtype)
    q_pe = torch.randn(batch, H, R, generator=gen).to(dtype)
    w_uk = (torch.randn(H, P, L, generator=gen) * 0.05).to(dtype)
    w_uv = (torch.randn(H, V, L, generator=gen) * 0.05).to(dtype)
    return q_nope, q_pe, k_cache, v_cache, meta.decode, w_uk, w_uv, (P + R) ** -0.5


def bench_layer(args: argparse.Namespace, dtype: torch.dtype) -> None:
    case = decode_case(args.batch, args.context, args.block_size, dtype)
    s = case[4].block_table.shape[1] * args.block_size
    analytic = args.batch * s * (L + R) * dtype.itemsize
    print(f"one layer, batch {args.batch} x context {args.context}, block {args.block_size}, "
          f"{H} heads, {dtype}: padded copy B*S*(L+R)*bytes = {analytic / MIB:.1f} MiB")
    print(f"{'path':<28}{'peak extra MiB':>16}{'vs padded copy':>16}{'ms':>10}")
    rows = [(f"padded gather (old)", lambda: padded_decode(*case))]
    rows += [(f"tiled, {t} tokens/tile", lambda t=t: decode_absorbed(*case, tile_tokens=t))
             for t in args.tiles]
    base_ms = None
    for name, fn in rows:
        ms = 1e3 * best_time(fn, args.repeats)
        base_ms = base_ms or ms
        peak = peak_extra_bytes(fn)
        print(f"{name:<28}{peak / MIB:>16.1f}{peak / analytic:>16.3f}{ms:>10.1f}"
              f"  ({ms / base_ms:.2f}x old time)")
    torch.testing.assert_close(rows[0][1](), rows[1][1](), atol=2e-2, rtol=2e-2)


def bench_model_step(args: argparse.Namespace) -> None:
    KERNELS.register("mla_decode", "padded", ("cpu",), lambda: padded_decode)
    per_seq = -(-(args.context + 1) // args.block_size)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(tmp, seed=0, hidden_size=256, num_heads=8,
                                     kv_lora_rank=L, n_routed_experts=16, num_layers=2,
                                     max_position_embeddings=2 * args.context)
        runners = {name: ModelRunner(ckpt, num_kv_blocks=args.batch * per_seq,
                                     block_size=args.block_size,
                                     kernel_choices={"mla_decode": variant})
                   for name, variant in (("padded gather (old)", "padded"),
                                         ("tiled (default)", "absorbed"))}
    step = [SeqStep(str(b), (7,), args.context, tuple(range(b * per_seq, (b + 1) * per_seq)))
            for b in range(args.batch)]
    cfg = next(iter(runners.values())).model_config
    analytic = args.batch * per_seq * args.block_size * (L + cfg.qk_rope_head_dim) * 4
    print(f"\nwhole decode step, tiny model (hidden 256, 8 heads, kv_lora {L}, 2 layers, fp32), "
          f"batch {args.batch} x context {args.context}: padded copy of one layer "
          f"{analytic / MIB:.1f} MiB")
    meta_ms = 1e3 * best_time(lambda: build_attention_metadata(
        [1] * args.batch, [args.context] * args.batch, [s.block_ids for s in step],
        args.block_size), args.repeats)
    cache = BlockTableCache(args.batch * per_seq)
    ids, tables = [s.request_id for s in step], [s.block_ids for s in step]
    cache.tensors(ids, tables)  # the tables of earlier steps (a steady decode batch)
    cached_ms = 1e3 * best_time(lambda: build_attention_metadata(
        [1] * args.batch, [args.context] * args.batch, cache.tensors(ids, tables),
        args.block_size), args.repeats)
    print(f"build_attention_metadata of the step (block tables included): {meta_ms:.2f} ms "
          f"from tuples, {cached_ms:.2f} ms with the runner's BlockTableCache")
    print(f"{'path':<28}{'peak extra MiB':>16}{'vs padded copy':>16}{'ms':>10}")
    base_ms = None
    for name, runner in runners.items():
        ms = 1e3 * best_time(lambda r=runner: r.execute(step), args.repeats)
        base_ms = base_ms or ms
        peak = peak_extra_bytes(lambda r=runner: r.execute(step))
        print(f"{name:<28}{peak / MIB:>16.1f}{peak / analytic:>16.3f}{ms:>10.1f}"
              f"  ({ms / base_ms:.2f}x old time)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tiles", type=int, nargs="+", default=[64, 256, 1024],
                        help="tokens per tile of the one-layer rows (the default is 256)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of part 1 (CPU bf16 matmuls are slow; the ratios hold)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, best of {args.repeats}")
    with torch.inference_mode():
        bench_layer(args, getattr(torch, args.dtype))
        bench_model_step(args)


if __name__ == "__main__":
    main()

"""One MoE layer at 4 ranks: expert parallelism vs TP-sharded experts (CPU, gloo).

Layouts, each 4 processes: ``TP4`` (dp1 x tp4, every expert TP-split, EP off), ``EP4 dp4xtp1``
and ``EP4 dp2xtp2`` (each rank holds n_routed_experts / 4 whole experts). Every DP rank gets
``T`` tokens per step (so TP4 computes T tokens per step, dp4 4T, dp2 2T). Per step: the MoE
forward plus the decoder layer's TP all-reduce after it, median of ``--repeats`` after 2
warm-ups, on EP/TP rank 0; and the bytes one rank sends to other ranks per step (all-to-all:
rows to other ranks + counts; TP all-reduce: ring, ``2 (tp-1)/tp * T * hidden * 4``), mean
over ranks. Random weights (router replicated from one seed), fp32, 1 thread per rank.
Not a test; run: ``PYTHONPATH=. python benchmarks/moe_bench.py``.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp

from engine.layout import tp_layout
from engine.model_config import ModelConfig
from engine.moe import MoE, fuse_weights
from engine.parallel import EPGroup, ep_rank_of, init_ep_group, init_tp_group
from orchestrator.tiny_model import tiny_config_dict

LAYOUTS = {"TP4": (1, 4, False), "EP4 dp4xtp1": (4, 1, True), "EP4 dp2xtp2": (2, 2, True)}


def bench_config(hidden: int, experts: int) -> ModelConfig:
    """The tiny DeepSeek-V3 config, wider: ``hidden``, ``experts`` routed experts of width
    ``hidden / 2``, top-3 of 4 groups."""
    raw = tiny_config_dict(hidden_size=hidden, n_routed_experts=experts)
    return ModelConfig.from_dict(dict(raw, moe_intermediate_size=hidden // 2))


class _CountingEP(EPGroup):
    """An EPGroup that adds the bytes this rank sends to OTHER ranks to ``sent[0]``."""

    def __init__(self, ep: EPGroup, sent: list[int]) -> None:
        super().__init__(ep.rank, ep.size, ep.group)
        object.__setattr__(self, "sent", sent)

    def all_to_all_counts(self, send: torch.Tensor) -> torch.Tensor:
        self.sent[0] += send.numel() * send.element_size() * (self.size - 1) // self.size
        return super().all_to_all_counts(send)

    def all_to_all_rows(self, x, send_splits, recv_splits):
        others = sum(send_splits) - send_splits[self.rank]
        self.sent[0] += others * x[0].numel() * x.element_size() if len(x) else 0
        return super().all_to_all_rows(x, send_splits, recv_splits)


def _build(config: ModelConfig, tp, ep) -> MoE:
    layout = tp_layout(config, tp.size, ep.size, ep.rank)
    torch.manual_seed(0)  # the router (built first) is the same on every rank
    moe = MoE(config, layout, tp, ep)
    fuse_weights(moe)  # as build_model does: TP-sharded experts run as grouped GEMMs
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    return moe.eval()


def _rank_main(index: int, layout: str, tokens: list[int], repeats: int, hidden: int,
               experts: int, ports: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    dp, tp_size, use_ep = LAYOUTS[layout]
    dp_rank, tp_rank = divmod(index, tp_size)
    tp = init_tp_group(tp_rank, tp_size, "127.0.0.1", ports[1 + dp_rank])
    ep = init_ep_group(ep_rank_of(dp_rank, tp_rank, tp_size), dp * tp_size, "127.0.0.1",
                       ports[0]) if use_ep else EPGroup()
    sent = [0]
    config = bench_config(hidden, experts)
    moe = _build(config, tp, _CountingEP(ep, sent) if use_ep else ep)
    rows = []
    with torch.inference_mode():
        for t in tokens:
            x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(dp_rank))
            times, sent[0] = [], 0
            for _ in range(repeats + 2):
                start = time.perf_counter()
                tp.all_reduce(moe(x))
                times.append(time.perf_counter() - start)
            ring = 2 * (tp_size - 1) * t * hidden * 4 // tp_size
            rows.append((t, statistics.median(times[2:]), sent[0] / (repeats + 2) + ring))
    torch.save(rows, f"{out_dir}/{index}.pt")
    ep.destroy()
    tp.destroy()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: str, args: argparse.Namespace) -> list[tuple[int, float, float]]:
    """(T, median step s on rank 0, mean bytes sent per rank per step) per token count."""
    with tempfile.TemporaryDirectory() as out:
        ports = [_free_port() for _ in range(5)]
        mp.start_processes(_rank_main, args=(layout, args.tokens, args.repeats, args.hidden,
                                             args.experts, ports, out),
                           nprocs=4, join=True, start_method="spawn")
        per_rank = [torch.load(f"{out}/{i}.pt") for i in range(4)]
    return [(t, sec, statistics.mean(r[k][2] for r in per_rank))
            for k, (t, sec, _) in enumerate(per_rank[0])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512],
                        help="tokens per DP rank per step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    args = parser.parse_args()
    cfg = bench_config(args.hidden, args.experts)
    print(f"MoE layer, 4 ranks, hidden {args.hidden}, {args.experts} routed experts of "
          f"{cfg.moe_intermediate_size} (+1 shared), top-{cfg.num_experts_per_tok}, fp32")
    print(f"{'layout':<13}{'T/DP rank':>10}{'tokens/step':>12}{'step ms':>9}"
          f"{'ktok/s':>8}{'KiB sent/rank':>15}")
    for layout, (dp, _, _) in LAYOUTS.items():
        for t, sec, sent in run_layout(layout, args):
            print(f"{layout:<13}{t:>10}{t * dp:>12}{sec * 1e3:>9.2f}"
                  f"{t * dp / sec / 1e3:>8.1f}{sent / 1024:>15.1f}")


if __name__ == "__main__":
    main()

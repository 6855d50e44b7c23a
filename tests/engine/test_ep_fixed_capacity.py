"""The capture-safe EP dispatch (engine/expert_parallel.py ``ep_routed_fixed``: fixed slots,
no ``.tolist()``) equals the exact-split one on spawned gloo ranks, DP2 x TP2 (EP 4) with an
idle rank and uneven token counts; its capacity bound is an error, not a silent drop."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from engine.expert_parallel import ep_routed, ep_routed_fixed
from engine.parallel import EPGroup, TPGroup, init_ep_group
from tests.ports import free_port
from tests.rank_processes import START_METHOD

HIDDEN, N_LOCAL, K, CAPACITY = 16, 2, 3, 4
TOKENS = (7, 0, 5, 8)  # per DP rank x TP rank: DP rank 1's TP rank 0 routes nothing


class Expert(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.up = nn.Parameter(torch.randn(HIDDEN, 32, generator=g) / 4)
        self.down = nn.Parameter(torch.randn(32, HIDDEN, generator=g) / 4)

    def forward(self, x):
        return torch.nn.functional.silu(x @ self.up) @ self.down


def _gate(num_experts: int):
    def gate(xs):
        scores = xs[:, :num_experts] * 3  # deterministic: every rank routes alike
        weights, ids = scores.softmax(-1).topk(K, dim=-1)
        return weights.float(), ids
    return gate


def _rank(index: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    size, tp_size = 4, 2
    ep = init_ep_group(index, size, port=port, timeout_s=60)
    tp = TPGroup(rank=index % tp_size, size=tp_size)  # token_slice needs no TP collective
    experts = [Expert(100 + index * N_LOCAL + j) for j in range(N_LOCAL)]
    x = torch.randn(2 * TOKENS[index], HIDDEN, generator=torch.Generator().manual_seed(index))
    gate = _gate(N_LOCAL * size)
    with torch.no_grad():
        exact = ep_routed(x, gate, experts, ep, tp)
        fixed = ep_routed_fixed(x, gate, experts, ep, tp, CAPACITY * 2)
    torch.save((exact, fixed), f"{out_dir}/rank{index}.pt")
    ep.destroy()


def test_fixed_capacity_dispatch_equals_the_exact_one(tmp_path):
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=4, join=True,
                       start_method=START_METHOD)
    got = {i: torch.load(tmp_path / f"rank{i}.pt") for i in range(4)}
    for index, (exact, fixed) in got.items():
        assert exact.shape == fixed.shape == (2 * TOKENS[index], HIDDEN)
        assert exact.abs().sum() > 0 or TOKENS[index] == 0
        assert torch.allclose(fixed, exact, atol=1e-5), (index, (fixed - exact).abs().max())


def test_a_step_over_capacity_is_refused_naming_the_fix():
    x = torch.randn(10, HIDDEN)
    with pytest.raises(ValueError, match="raise decode.graph.batch_sizes"):
        ep_routed_fixed(x, _gate(4), [Expert(j) for j in range(4)], EPGroup(), TPGroup(), 4)


def test_fixed_dispatch_at_ep1_equals_the_local_experts():
    x = torch.randn(5, HIDDEN)
    experts, gate = [Expert(j) for j in range(4)], _gate(4)
    with torch.no_grad():
        assert torch.allclose(ep_routed_fixed(x, gate, experts, EPGroup(), TPGroup(), 5),
                              ep_routed(x, gate, experts, EPGroup(), TPGroup()), atol=1e-6)

"""MoE routed experts as two grouped GEMMs over stacked expert weights, without host syncs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine.forward_context import build_attention_metadata
from engine.layout import tp_layout
from engine.model_config import ModelConfig
from engine.moe import MoE, fuse_weights
from engine.parallel import EPGroup, TPGroup
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import tiny_config_dict

BLOCK = 16
_SYNCS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def _no_host_reads():
    """Every way Python reads a tensor's value back (``.tolist()``, ``.item()``, ``int()``,
    ``float()``, ``bool()``, use as an index) raises AssertionError inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in _SYNCS}

    def refuse(name):
        def raise_(*_args, **_kwargs):
            raise AssertionError(f"host sync: Tensor.{name} called in the forward")
        return raise_

    try:
        for name in _SYNCS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _moe_pair(dtype: torch.dtype) -> tuple[MoE, MoE]:
    """Two MoE layers with the same random weights: one per-expert (as quantized experts
    run), one with stacked storage filled through its per-expert parameter names."""
    config = ModelConfig.from_dict(tiny_config_dict(hidden_size=48, n_routed_experts=8))
    layout = tp_layout(config, 1)
    looped, stacked = (MoE(config, layout, TPGroup(), EPGroup()).to(dtype) for _ in range(2))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in looped.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    fuse_weights(stacked)
    stacked.load_state_dict(looped.state_dict())
    assert looped.w_gate_up is None and stacked.w_gate_up is not None
    return looped, stacked


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [0, 1, 5, 64])  # 1: most of the 8 experts get no rows
def test_grouped_experts_equal_the_per_expert_loop(dtype, tol, tokens):
    looped, stacked = _moe_pair(dtype)
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.no_grad():
        ref, out = looped(x), stacked(x)
    assert out.shape == (tokens, 48) and out.dtype == dtype
    peak = float(ref.abs().max()) if tokens else 0.0
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * peak)


def test_stacked_experts_are_the_checkpoint_parameters():
    _, stacked = _moe_pair(torch.float32)
    expert = stacked.experts["3"]
    i = expert.gate_proj.weight.shape[0]
    assert torch.equal(stacked.w_gate_up[3, :i], expert.gate_proj.weight)
    assert torch.equal(stacked.w_gate_up[3, i:], expert.up_proj.weight)
    assert stacked.w_down[3].data_ptr() == expert.down_proj.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_forward_reads_nothing_back_to_the_host(tiny_ckpt, dtype):
    runner = ModelRunner(tiny_ckpt, num_kv_blocks=8, block_size=BLOCK, dtype=dtype)
    tables = [(0, 1), (2, 3), (4, 5)]
    prompts = [tuple(range(3 + 5 * b, 3 + 5 * b + 9 + b)) for b in range(3)]
    runner.execute([SeqStep(str(b), p, 0, tables[b]) for b, p in enumerate(prompts)])
    lens = [len(p) for p in prompts]
    meta = build_attention_metadata([1, 1, 1], lens, tables, BLOCK, runner.device)
    ids = torch.tensor([7, 8, 9])
    with torch.inference_mode():
        expected = runner.model(ids, meta, runner.kv_cache)
        with _no_host_reads():
            logits = runner.model(ids, meta, runner.kv_cache)
    assert torch.equal(logits, expected)

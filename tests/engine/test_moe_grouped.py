"""MoE routed experts as two grouped GEMMs over stacked expert weights, without host syncs."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine.forward_context import build_attention_metadata
from engine.runner import ModelRunner, SeqStep

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

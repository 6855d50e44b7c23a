"""PD end to end on an int8 W8A8 checkpoint (written by `orch model quantize`): 16 ShareGPT
prompts, greedy, equal token for token to colocated execution of the same checkpoint (the
engine alone, tests/e2e/baseline.py); every block free afterwards.

NOTE: prefill and decode both run tp1 here: W8A8 quantizes each row-parallel layer's LOCAL
input per token, so outputs depend on tp (docs/quantization.md); equal tp on both sides is
what makes PD and colocated compute the same numbers (the engine alone runs tp 1 too)."""

from __future__ import annotations

import pytest

from engine.quant.writer import quantize_checkpoint
from orchestrator.config.checkpoint import ensure_checkpoint
from orchestrator.config.sections import ModelSection
from tests.e2e.baseline import engine_greedy, router_token_ids
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory):
    """The built-in tiny checkpoint (the one `model.path: tiny` serves) as W8A8."""
    return quantize_checkpoint(ensure_checkpoint(ModelSection()), tmp_path_factory.mktemp("w8a8"),
                               "w8a8")


def test_w8a8_disaggregated_equals_colocated(w8a8_dir, prompts, tmp_path, joined_ray):
    overrides = {"model.path": str(w8a8_dir), "decode.tp": 1, **joined_ray}
    with OrchProcess(REPO / "configs" / "1p1d.yaml", tmp_path, overrides) as orch:
        pd = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        wait_idle(orch)
    colocated = engine_greedy(w8a8_dir, router_token_ids(w8a8_dir, prompts), MAX_TOKENS)
    assert all(len(o) == MAX_TOKENS for o in pd)
    for i, (a, b) in enumerate(zip(pd, colocated)):
        assert a == b, f"request {i}: PD {a} != colocated {b}"

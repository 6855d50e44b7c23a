"""PD end to end on an int8 W8A8 checkpoint (written by `orch model quantize`): 16 ShareGPT
prompts, greedy, equal token for token to colocated serving of the same checkpoint; every
block free afterwards.

NOTE: prefill and decode both run tp1 here: W8A8 quantizes each row-parallel layer's LOCAL
input per token, so outputs depend on tp (docs/quantization.md); equal tp on both sides is
what makes PD and colocated compute the same numbers."""

from __future__ import annotations

import pytest

from engine.quant.writer import quantize_checkpoint
from orchestrator.checkpoint import ensure_checkpoint
from orchestrator.config_sections import ModelSection
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory):
    """The built-in tiny checkpoint (the one `model.path: tiny` serves) as W8A8."""
    return quantize_checkpoint(ensure_checkpoint(ModelSection()), tmp_path_factory.mktemp("w8a8"),
                               "w8a8")


def _serve(config: str, ckpt, tmp, prompts, overrides=None) -> list[list[int]]:
    with OrchProcess(REPO / "configs" / config, tmp,
                     {"model.path": str(ckpt), **(overrides or {})}) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        wait_idle(orch)
    return outputs


def test_w8a8_disaggregated_equals_colocated(w8a8_dir, prompts, tmp_path):
    colocated = _serve("colocated.yaml", w8a8_dir, tmp_path, prompts)
    pd = _serve("1p1d.yaml", w8a8_dir, tmp_path, prompts, {"decode.tp": 1})
    assert all(len(o) == MAX_TOKENS for o in pd)
    for i, (a, b) in enumerate(zip(pd, colocated)):
        assert a == b, f"request {i}: PD {a} != colocated {b}"

"""The check a quantized DeepSeek-V4 checkpoint passes (tests/engine/test_v4_fp8.py,
test_v4_fp4.py): orch on the quantized checkpoint equals transformers' DeepseekV4ForCausalLM
(fp32) on its dequantized float twin, equals orch on that twin, and is not the unquantized
original (the quantization is real)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.v4.loader import load_v4

TOL = 1e-4  # as tests/engine/test_v4_hf_parity.py: the same weights, fp32 both sides


def assert_quantized_equals_hf(quantized: Path, twin: Path, original: Path,
                               num_tokens: int = 23) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Logits of ``num_tokens`` random tokens from orch on ``quantized`` within :data:`TOL` of
    transformers on ``twin`` (greedy tokens equal), exactly orch's on ``twin``, and more than
    10 x TOL away from orch's on ``original``. Returns orch's models on ``quantized`` and
    ``original``."""
    from transformers import DeepseekV4ForCausalLM  # noqa: PLC0415 (reference only)

    hf = DeepseekV4ForCausalLM.from_pretrained(twin, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ours, plain, unquantized = load_v4(quantized), load_v4(twin), load_v4(original)
    ids = torch.randint(0, 129000, (num_tokens,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
        got = ours(ids, ours.new_cache())
        assert torch.equal(got, plain(ids, plain.new_cache()))
        far = unquantized(ids, unquantized.new_cache())
    assert (got - ref).abs().max().item() < TOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    assert (got - far).abs().max().item() > 10 * TOL
    return ours, unquantized

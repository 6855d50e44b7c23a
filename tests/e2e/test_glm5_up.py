"""GLM-5 (glm_moe_dsa, GLM-5.2-style shared indexer layers) end to end: `orch up
configs/glm5_1p1d.yaml` as P2 -> D1 and as P1 -> D2 (the KV transfer ships index_k of the full
layers only) gives the same greedy tokens as colocated execution (the engine alone,
tests/e2e/baseline.py) on the same tiny checkpoint, for 16 concurrent ShareGPT prompts, the
longest past ``index_topk``, and the same as transformers' GlmMoeDsaForCausalLM on the three
longest; afterwards every block is free on every instance."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from transformers import GlmMoeDsaForCausalLM

from orchestrator.config.load import load_config
from tests.e2e.baseline import engine_greedy, router_token_ids
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_glm5_disaggregated_equals_colocated(tmp_path, prompts, joined_ray, prefill_tp,
                                             decode_tp):
    overrides = {**joined_ray, "prefill.tp": prefill_tp, "decode.tp": decode_tp}
    with OrchProcess(REPO / "configs" / "glm5_1p1d.yaml", tmp_path, overrides) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        _, responses, err = orch.generate(max(prompts, key=len), max_tokens=1)
        wait_idle(orch)
        assert sorted(i.role for i in orch.status().instances) == ["decode", "prefill"]
    checkpoint = load_config(orch.config).model.checkpoint_dir()
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and "shared" in config["indexer_types"]
    assert err is None and responses[-1].stats.prompt_tokens > config["index_topk"], \
        "no prompt is longer than index_topk: attention would be dense"
    assert all(len(o) == MAX_TOKENS for o in outputs)
    colocated, hf = _references(checkpoint, tuple(prompts))
    for i, (pd, co) in enumerate(zip(outputs, colocated)):
        assert pd == co, f"request {i}: PD {pd} != colocated {co}"
    for i, ref in hf.items():
        assert outputs[i] == ref, f"request {i}: PD != transformers"


@functools.cache
def _references(checkpoint: Path, prompts: tuple[str, ...]) -> tuple[list[list[int]],
                                                                      dict[int, list[int]]]:
    """The greedy ``MAX_TOKENS`` of each prompt from the engine alone, and from transformers
    for the three longest (prompt index -> tokens), on ``checkpoint``.

    NOTE: both parametrizations serve the same checkpoint (model.tiny_seed 0) and prompts, so
    the references are computed once (~5 s of CI each time)."""
    ids = router_token_ids(checkpoint, list(prompts))
    colocated = engine_greedy(checkpoint, ids, MAX_TOKENS)
    model = GlmMoeDsaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf = {}
    for i in sorted(range(len(ids)), key=lambda j: len(ids[j]))[-3:]:
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids[i]]), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
        hf[i] = ref[0, len(ids[i]):].tolist()
    return colocated, hf

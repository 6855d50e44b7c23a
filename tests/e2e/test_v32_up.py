"""DeepSeek-V3.2 (sparse attention) end to end: `orch up configs/v32_1p1d.yaml` (P1 -> D2, the
KV transfer ships K, V and the indexer keys) gives the same greedy tokens as colocated
execution (the engine alone, tests/e2e/baseline.py) on the same tiny V3.2 checkpoint, for 16
concurrent ShareGPT prompts longer than ``index_topk``; afterwards every block is free on every
instance."""

from __future__ import annotations

import json

from orchestrator.config.load import load_config
from tests.e2e.baseline import engine_greedy, router_token_ids
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle


def test_v32_disaggregated_equals_colocated(tmp_path, prompts, joined_ray):
    with OrchProcess(REPO / "configs" / "v32_1p1d.yaml", tmp_path, joined_ray) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        _, responses, err = orch.generate(max(prompts, key=len), max_tokens=1)
        wait_idle(orch)
        assert sorted(i.role for i in orch.status().instances) == ["decode", "prefill"]
    checkpoint = load_config(orch.config).model.checkpoint_dir()
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32"
    assert err is None and responses[-1].stats.prompt_tokens > config["index_topk"], \
        "no prompt is longer than index_topk: attention would be dense"
    assert all(len(o) == MAX_TOKENS for o in outputs)
    colocated = engine_greedy(checkpoint, router_token_ids(checkpoint, prompts), MAX_TOKENS)
    for i, (pd, co) in enumerate(zip(outputs, colocated)):
        assert pd == co, f"request {i}: PD {pd} != colocated {co}"

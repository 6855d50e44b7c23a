"""Context-parallel prefill end to end: `orch up configs/cp_1p1d.yaml` (prefill cp 2 with
q_b_proj and o_proj layer-sharded, decode tp 1; each CP rank ships only the KV of the chunk
pieces it computed) gives the same greedy tokens as colocated execution (the engine alone in
chunks of 64, tests/e2e/baseline.py) on long ShareGPT prompts (several hundred tokens, several
chunks each), and with the prefix cache on a second turn and a repeated prompt; afterwards every
block is free."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.config.load import load_config
from tests.e2e.baseline import engine_greedy, router_token_ids
from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, SHAREGPT, OrchProcess, wait_idle

NUM_LONG = 6
MIN_CHARS, MAX_CHARS = 1300, 1600  # 240-476 tokens: 2-4 chunks of 128; fits 512


def long_prompts(path: Path) -> list[str]:
    """The first ``NUM_LONG`` ShareGPT first human turns of at least ``MIN_CHARS``
    characters, cut to ``MAX_CHARS``."""
    out = []
    for item in json.loads(path.read_text()):
        turns = [t["value"] for t in item["conversations"] if t["from"] == "human"]
        if turns and len(turns[0]) >= MIN_CHARS:
            out.append(turns[0][:MAX_CHARS])
        if len(out) == NUM_LONG:
            return out
    raise RuntimeError(f"{path} has fewer than {NUM_LONG} prompts of {MIN_CHARS} characters")


def test_cp_prefill_equals_colocated_on_long_prompts(tmp_path, shared_data, joined_ray):
    prompts = long_prompts(shared_data(SHAREGPT))
    with OrchProcess(REPO / "configs" / "cp_1p1d.yaml", tmp_path, joined_ray) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        wait_idle(orch)
        checkpoint = load_config(orch.config).model.checkpoint_dir()
        token_ids = router_token_ids(checkpoint, prompts)
        # NOTE: prefix cache (pools of 64 blocks: the 6 prompts above evicted each other):
        # the shortest prompt again (cached on both sides after it), its second turn (decode
        # holds its prompt + output blocks, prefill its prompt's: the CP ranks ship a range
        # their chunk split did not make), the prompt once more (both sides hit)
        s = min(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        turn2 = (*token_ids[s], *outputs[s], 11, 12, 13)
        again = [token_ids[s], turn2, token_ids[s]]
        reused = [orch.generate(token_ids=ids, max_tokens=MAX_TOKENS) for ids in again]
        wait_idle(orch)
        prefill = [i for i in orch.status().instances if i.role == "prefill"]
    lengths = [len(ids) for ids in token_ids]
    colocated = engine_greedy(checkpoint, [*token_ids, turn2], MAX_TOKENS)
    assert all(len(o) == MAX_TOKENS for o in outputs)
    for i, (cp, co) in enumerate(zip(outputs, colocated)):
        assert cp == co, f"request {i} ({lengths[i]} tokens): CP prefill {cp} != colocated {co}"
    for (tokens, responses, err), co, hit in zip(reused, [colocated[s], colocated[-1],
                                                          colocated[s]], (False, True, True)):
        assert err is None and tokens == co
        held = 16 * ((len(token_ids[s]) - 1) // 16)  # full blocks, the last token computed
        assert not hit or responses[-1].stats.cached_tokens >= held
    assert len(prefill) == 1 and len(prefill[0].ranks) == 2, "one prefill instance of 2 ranks"
    assert min(lengths) > 200 and max(lengths) > 400, f"prompts must be long: {lengths}"

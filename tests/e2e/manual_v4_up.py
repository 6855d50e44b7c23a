"""MANUAL run (not collected by CI: a new bring-up; 110 s measured on the shared 2-core
machine at load average ~6 with the tiny checkpoint already made, 7 min at ~15; over the e2e
budget). DeepSeek-V4 end to end: `orch up configs/v4_colocated.yaml` (the tiny V4
checkpoint, colocated, one rank), then `orch up configs/v4_1p1d.yaml` as prefill tp 1 ->
decode tp 1, P2 -> D1 and P1 -> D2 (the V4 state shipped through the KV transfer chunk by
chunk, prefill chunks of 8 tokens: each prefill rank sends its planned layers, every decode
rank rebuilds the whole cache), then `orch
up configs/v4_ep_colocated.yaml` (two DP ranks, expert parallelism: 4 of 8 experts each, in
lockstep; and with decode.tp 2: EP over dp x tp = 4 ranks, 2 experts each) and `orch up
configs/v4_ep_2p2d.yaml` (PD, prefill dp 2 and decode dp 2, each an EP group; and with
prefill.tp 2: prefill EP over 4 ranks, P2 -> D1); each serves held-back
prompts concurrently and its greedy tokens equal transformers' ``DeepseekV4ForCausalLM``
(greedy `generate`) on the prompt ids the router computes; afterwards every
block is free.

    .venv/bin/python -m pytest -q tests/e2e/manual_v4_up.py
"""

from __future__ import annotations

import pytest
import torch

from orchestrator.config.load import load_config
from tests.e2e.baseline import router_token_ids
from tests.e2e.harness import REPO, OrchProcess, wait_idle

NEW = 32
# NOTE: held back: written for this test, never seen by the engine's unit tests
HELD_BACK = ["The lighthouse keeper counted the ships twice before dawn.",
             "Explain, in one sentence, why compressed attention keeps a sliding window of "
             "recent tokens next to its pooled entries.",
             "7 8 9"]


def _hf_greedy(checkpoint, prompts: list[tuple[int, ...]]) -> list[list[int]]:
    from transformers import DeepseekV4ForCausalLM  # noqa: PLC0415 (reference only)

    hf = DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None  # NOTE: served with ignore_eos
    with torch.no_grad():
        out = [hf.generate(torch.tensor(p)[None], max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    return out


_WANT: dict[str, list[list[int]]] = {}  # checkpoint -> transformers' tokens (once per run)


# NOTE: PD in prefill chunks of 8 tokens: the prompts' V4 rows ship chunk by chunk
CHUNKS = {"prefill.chunk_size": 8}


@pytest.mark.parametrize("config, tps", [("v4_colocated.yaml", {}),
                                         ("v4_1p1d.yaml", CHUNKS),
                                         ("v4_1p1d.yaml", {"prefill.tp": 2, "decode.tp": 1,
                                                           **CHUNKS}),
                                         ("v4_1p1d.yaml", {"prefill.tp": 1, "decode.tp": 2,
                                                           **CHUNKS}),
                                         ("v4_ep_colocated.yaml", {}),
                                         ("v4_ep_colocated.yaml", {"decode.tp": 2}),
                                         ("v4_ep_2p2d.yaml", CHUNKS),
                                         ("v4_ep_2p2d.yaml", {"prefill.tp": 2, **CHUNKS})],
                         ids=["colocated", "P1-D1", "P2-D1", "P1-D2", "ep_colocated",
                              "ep_tp2_colocated", "ep_2p2d", "ep_2p2d_P2-D1"])
def test_v4_serves_equal_to_transformers(tmp_path, joined_ray, config, tps):
    with OrchProcess(REPO / "configs" / config, tmp_path, {**joined_ray, **tps}) as orch:
        outputs = orch.generate_many(HELD_BACK, max_tokens=NEW, ignore_eos=True)
        wait_idle(orch)
    checkpoint = load_config(orch.config).model.checkpoint_dir()
    if str(checkpoint) not in _WANT:
        _WANT[str(checkpoint)] = _hf_greedy(checkpoint, router_token_ids(checkpoint,
                                                                         HELD_BACK))
    for i, (got, ref) in enumerate(zip(outputs, _WANT[str(checkpoint)])):
        assert got == ref, f"{config} prompt {i}: orch {got} != transformers {ref}"

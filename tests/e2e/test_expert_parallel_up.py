"""`orch up configs/ep_1p1d.yaml` end to end (issue 11): prefill dp1 x tp2 and decode dp2 x tp1,
both expert-parallel, on the tiny model (8 routed experts, 4 per rank); 16 concurrent ShareGPT
prompts, greedy, equal to the colocated baseline token for token; both decode DP ranks served
requests (KV reached each); afterwards every block is free and nothing is in flight."""

from __future__ import annotations

import time

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle


def _decode_instances_fed(orch: OrchProcess, timeout_s: float = 30) -> set[str]:
    """Decode instances KV was sent to (per-pair transfer metrics; the router records them at
    its status polls, so wait for both, bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        fed = {key.split("->")[1].split(":")[0] for key, value in orch.metrics().items()
               if key.startswith("orch_kv_transfer_bytes_total{") and value > 0}
        if fed >= {"decode-0", "decode-1"} or time.monotonic() > deadline:
            return fed
        time.sleep(0.5)


def test_expert_parallel_pd_equals_colocated(tmp_path, prompts, colocated_outputs, joined_ray):
    with OrchProcess(REPO / "configs" / "ep_1p1d.yaml", tmp_path, joined_ray) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        status = orch.status()
        assert sorted((i.name, i.tp) for i in status.instances) == [
            ("decode-0", 1), ("decode-1", 1), ("prefill-0", 2)]
        assert all(len(o) == MAX_TOKENS for o in outputs)
        for i, (ep, co) in enumerate(zip(outputs, colocated_outputs)):
            assert ep == co, f"request {i}: EP {ep} != colocated {co}"
        assert _decode_instances_fed(orch) == {"decode-0", "decode-1"}
        wait_idle(orch)

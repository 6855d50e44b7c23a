"""MTP speculative decoding end to end: `orch up configs/mtp_1p1d.yaml` (prefill tp1 runs the
MTP module over prompts and ships its KV as one more layer, decode tp2 drafts and verifies),
16 concurrent greedy requests equal the colocated baseline (no MTP) token for token; `orch
status` and /metrics carry the decode instance's acceptance numbers; every block comes back.

The tiny checkpoint is written fresh (``model.tiny_dir``) with seed 0: its main weights are
the baseline's (the MTP weights come from a second generator), plus an MTP module."""

from __future__ import annotations

import time

from tests.e2e.conftest import MAX_TOKENS
from tests.e2e.harness import REPO, OrchProcess, wait_idle


def test_mtp_disaggregated_equals_colocated(tmp_path_factory, joined_ray, prompts,
                                            colocated_outputs):
    tmp = tmp_path_factory.mktemp("mtp")
    overrides = {"model.tiny_seed": 0, "model.tiny_dir": str(tmp / "tiny-mtp"),
                 "prefill.chunk_size": 64, **joined_ray}
    with OrchProcess(REPO / "configs" / "mtp_1p1d.yaml", tmp, overrides) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        for i, (got, want) in enumerate(zip(outputs, colocated_outputs)):
            assert got == want, f"request {i}: MTP PD {got} != colocated {want}"
        decode = next(i for i in orch.status().instances if i.role == "decode")
        assert decode.has_load and decode.spec_mean_accepted_length >= 1.0
        key = "orch_instance_spec_mean_accepted_length{instance=decode-0}"
        deadline = time.monotonic() + 30
        while orch.metrics().get(key, 0.0) < 1.0:  # NOTE: the router refreshes it periodically
            assert time.monotonic() < deadline, f"{key} not reported: {orch.metrics()}"
            time.sleep(0.5)
        wait_idle(orch)

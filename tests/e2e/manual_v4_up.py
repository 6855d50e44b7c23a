"""MANUAL run (not collected by CI: new bring-ups over the e2e budget; P1 -> D1 and
P1 -> D2 run in CI, tests/e2e/test_v4_up.py). DeepSeek-V4 end to end: `orch up
configs/v4_colocated.yaml` (the tiny V4 checkpoint, colocated, one rank), `orch up
configs/v4_1p1d.yaml` as P2 -> D1 (each prefill rank sends its planned layers, chunk by
chunk), then `orch up configs/v4_ep_colocated.yaml` (two DP ranks, expert parallelism: 4 of
8 experts each, in lockstep; and with decode.tp 2: EP over dp x tp = 4 ranks, 2 experts
each) and `orch up configs/v4_ep_2p2d.yaml` (PD, prefill dp 2 and decode dp 2, each an EP
group; and with prefill.tp 2: prefill EP over 4 ranks, P2 -> D1); each serves held-back
prompts concurrently and its greedy tokens equal transformers' ``DeepseekV4ForCausalLM``
on the prompt ids the router computes; afterwards every block is free. Colocated took 25 s
on the 2-core machine at load ~2.

    .venv/bin/python -m pytest -q tests/e2e/manual_v4_up.py
"""

from __future__ import annotations

import pytest

from tests.e2e.test_v4_up import CHUNKS, serves_equal_to_transformers


@pytest.mark.parametrize("config, tps", [("v4_colocated.yaml", {}),
                                         ("v4_1p1d.yaml", {"prefill.tp": 2, "decode.tp": 1,
                                                           **CHUNKS}),
                                         ("v4_ep_colocated.yaml", {}),
                                         ("v4_ep_colocated.yaml", {"decode.tp": 2}),
                                         ("v4_ep_2p2d.yaml", CHUNKS),
                                         ("v4_ep_2p2d.yaml", {"prefill.tp": 2, **CHUNKS})],
                         ids=["colocated", "P2-D1", "ep_colocated", "ep_tp2_colocated",
                              "ep_2p2d", "ep_2p2d_P2-D1"])
def test_v4_serves_equal_to_transformers(tmp_path, joined_ray, config, tps):
    serves_equal_to_transformers(tmp_path, {**joined_ray, **tps}, config)

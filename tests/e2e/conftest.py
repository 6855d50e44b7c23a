"""Shared fixtures of the end-to-end tests: the prompts, the colocated baseline outputs and the
overrides that make `orch up` join the session Ray."""

from __future__ import annotations

import time

import pytest

from orchestrator.api.convert import status_from_proto
from tests.e2e.harness import REPO, SHAREGPT, OrchProcess, sharegpt_prompts, wait_idle

NUM_REQUESTS = 16
MAX_TOKENS = 12


@pytest.fixture(scope="session")
def joined_ray(ray_session) -> dict[str, str]:
    """Overrides for OrchProcess: `orch up` joins the session Ray (``ray_session``) instead of
    starting an embedded one (~8 s of CI per bring-up). Its placement groups and actors go
    when it exits (test_rank_death checks that).

    NOTE: the embedded path keeps its own tests (test_embedded_ray, test_up_interrupt,
    test_fault_log, test_bench_up, tests/orchestrator/test_up.py).
    """
    return {"cluster.address": ray_session.get_runtime_context().gcs_address,
            "cluster.bind_host": "127.0.0.1"}


@pytest.fixture(scope="session")
def prompts(shared_data):
    return sharegpt_prompts(shared_data(SHAREGPT), NUM_REQUESTS)


@pytest.fixture(scope="session")
def colocated_outputs(tmp_path_factory, prompts, joined_ray):
    """Greedy outputs of the colocated baseline (`orch up configs/colocated.yaml`).

    NOTE: with prefill graph mode on (docs/engine.md "Graph mode (prefill)"): the layouts
    compared with it run prefill eager, so each of those tests also checks, end to end and
    token for token, that the feature on equals it off (its prompts arrive together: the
    first steps are prefill-only, several prompts each).
    """
    with OrchProcess(REPO / "configs" / "colocated.yaml", tmp_path_factory.mktemp("colocated"),
                     {"prefill.graph.enabled": True, "prefill.graph.required": True,
                      **joined_ray}) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        wait_idle(orch)
        assert ("prefill", "captured") in _graph_modes(orch, "colocated-0")
    return outputs


def _graph_modes(orch: OrchProcess, instance: str, timeout_s: float = 30.0) -> tuple:
    """``instance``'s graph modes in `orch status` (its load reported at least once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        views = {v.name: v for v in status_from_proto(orch.status())}
        if views[instance].status is not None or time.monotonic() > deadline:
            return views[instance].status.graph_modes if views[instance].status else ()
        time.sleep(0.2)

"""Shared fixtures of the end-to-end tests: the prompts and the colocated baseline outputs."""

from __future__ import annotations

import pytest

from tests.e2e.harness import REPO, SHAREGPT, OrchProcess, sharegpt_prompts, wait_idle

NUM_REQUESTS = 16
MAX_TOKENS = 12


@pytest.fixture(scope="session")
def prompts(shared_data):
    return sharegpt_prompts(shared_data(SHAREGPT), NUM_REQUESTS)


@pytest.fixture(scope="session")
def colocated_outputs(tmp_path_factory, prompts):
    """Greedy outputs of the colocated baseline (`orch up configs/colocated.yaml`)."""
    with OrchProcess(REPO / "configs" / "colocated.yaml",
                     tmp_path_factory.mktemp("colocated")) as orch:
        outputs = orch.generate_many(prompts, max_tokens=MAX_TOKENS)
        wait_idle(orch)
    return outputs

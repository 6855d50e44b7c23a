"""Fixtures of the engine tests: tiny random DeepSeek-V3 (and V3.2) checkpoints, written once per
session."""

from __future__ import annotations

import pytest
import torch

from orchestrator.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Default tiny checkpoint: q_lora_rank 48, YaRN, 1 dense + 2 MoE layers, per-expert names."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_no_qlora(tmp_path_factory):
    """q_lora_rank null (plain q_proj, V2-Lite style) and plain rope (no YaRN)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_noq"), seed=1, q_lora_rank=None,
                                 yarn=False)


@pytest.fixture(scope="session")
def tiny_dsa_ckpt(tmp_path_factory):
    """DeepSeek-V3.2 (index_topk 32, 16 indexer heads of 32 dims), written by the CLI
    ``orch model init-tiny --arch deepseek_v32 --seed 3``."""
    from orchestrator.cli import main  # noqa: PLC0415 (only this fixture needs the CLI)

    out = tmp_path_factory.mktemp("dsa") / "v32"
    assert main(["model", "init-tiny", "--arch", "deepseek_v32", "--seed", "3", str(out)]) == 0
    return out

"""Fixtures of the engine tests: tiny random DeepSeek-V3 checkpoints, written once per session."""

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

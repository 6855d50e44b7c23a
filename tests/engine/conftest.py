"""Fixtures of the engine tests: tiny random DeepSeek-V3 (V3.2, GLM-5) checkpoints, written once
per session."""

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


@pytest.fixture(scope="session")
def tiny_glm_ckpt(tmp_path_factory):
    """GLM-5 (every layer a full indexer), ``orch model init-tiny --arch glm_moe_dsa --seed 5``."""
    return _init_tiny(tmp_path_factory, "glm_moe_dsa")


@pytest.fixture(scope="session")
def tiny_glm_shared_ckpt(tmp_path_factory):
    """GLM-5.2-style (layers 1 and 3 shared), ``orch model init-tiny --arch glm_moe_dsa_shared
    --seed 5``."""
    return _init_tiny(tmp_path_factory, "glm_moe_dsa_shared")


def _init_tiny(tmp_path_factory, arch: str):
    from orchestrator.cli import main  # noqa: PLC0415 (only these fixtures need the CLI)

    out = tmp_path_factory.mktemp(arch) / arch
    assert main(["model", "init-tiny", "--arch", arch, "--seed", "5", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_v4_ckpt(tmp_path_factory):
    """DeepSeek-V4 (sliding, CSA, HCA, CSA layers; window 8, ratios 4 and 16), ``orch model
    init-tiny --arch deepseek_v4 --seed 5``."""
    return _init_tiny(tmp_path_factory, "deepseek_v4")

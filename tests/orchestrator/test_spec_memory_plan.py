"""The memory plan counts the MTP module and its KV cache when decode.speculative is on: the
module's row equals the parameters the engine builds for it, the cache row one layer's."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import KERNELS
from engine.model import build_model
from engine.model_config import ModelConfig
from engine.parallel import TPGroup
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import role_layouts
from orchestrator.config.memory_plan import Precision, plan_role
from orchestrator.tiny_model import tiny_config_dict


def _params(m: ModelConfig, mtp: bool) -> int:
    model = build_model(m, TPGroup(), KERNELS.resolve("cpu"), torch.float32,
                        torch.device("meta"), mtp=mtp)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("first_dense", [1, 4])  # MTP layer MoE, or dense (layer 3 < 4)
def test_mtp_rows_equal_what_the_engine_builds(first_dense):
    m = ModelConfig.from_dict(tiny_config_dict(mtp_layers=1, first_k_dense_replace=first_dense))
    cfg = load_config("configs/mtp_1p1d.yaml")
    for lay in role_layouts(cfg):
        if lay.tp != 1:
            continue
        rows = {r.kind: r for r in plan_role(m, lay, Precision.of("float32")).rows}
        assert rows["MTP module (speculative)"].elements == _params(m, True) - _params(m, False)
        kv = rows["KV cache: MTP layer"].elements
        assert kv * m.num_hidden_layers == rows["KV cache: c_kv latent"].elements \
            + rows["KV cache: k_pe"].elements
    plain = load_config("configs/1p1d.yaml")
    for lay in role_layouts(plain):
        kinds = {r.kind for r in plan_role(m, lay, Precision.of("float32")).rows}
        assert not any("MTP" in k for k in kinds)

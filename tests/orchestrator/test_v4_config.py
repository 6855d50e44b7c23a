"""configs/v4_colocated.yaml loads; what DeepSeek-V4 does not serve yet is refused at load with
every key to change (orchestrator/config/v4_check.py)."""

from __future__ import annotations

import pytest

from orchestrator.config.errors import ConfigError
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import check_memory
from tests.e2e.harness import REPO

CONFIG = REPO / "configs" / "v4_colocated.yaml"


def test_shipped_v4_config_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # NOTE: the tiny config, not made yet
    cfg = load_config(CONFIG)
    assert cfg.model.tiny_arch == "deepseek_v4" and cfg.mode == "colocated"
    assert check_memory(cfg).startswith("memory plan: fits cpu")


def test_unsupported_v4_layouts_are_refused_at_load(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, {"mode": "disaggregated", "decode.tp": 2,
                             "decode.prefix_cache": True, "decode.speculative": {}})
    for key in ("mode: disaggregated", "decode.tp=2", "decode.prefix_cache",
                "decode.speculative"):
        assert key in str(err.value)

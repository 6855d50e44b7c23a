"""The fit check `orch up` runs before anything starts (orchestrator/config/memory_check.py):
every shipped config fits, and a layout that does not is refused saying by how much and what
to change."""

from __future__ import annotations

import json
import re

import pytest

from orchestrator.config.devices import GB, device_memory
from orchestrator.config.errors import ConfigError
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import (MemoryPlanError, UnservableModelError,
                                              build_memory_plan, check_memory)
from tests.e2e.harness import REPO
from tests.orchestrator.deepseek_v3 import A3, V3_JSON, hand_plan


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_is_planned_and_fits(config):
    # NOTE: seed 004's V4 layout is planned; V4 serving refuses it (test_memory_plan_v4.py)
    cfg = load_config(REPO / "configs" / config, planning=config == "a3_v4_p2x16_d8x4.yaml")
    plan, source = build_memory_plan(cfg)
    assert plan is not None, source
    assert check_memory(cfg).startswith("memory plan: fits ")


def test_a3_replica_only_layout_is_refused_saying_by_how_much():
    cfg = load_config(A3, {"prefill.ep": False, "decode.ep": False})
    with pytest.raises(MemoryPlanError) as err:
        check_memory(cfg)
    message = str(err.value)
    plan, _ = build_memory_plan(cfg)
    for role, tp, blocks in (("prefill", 16, 768), ("decode", 4, 1088)):
        hand = hand_plan(tp, experts_per_rank=None, blocks=blocks, seqs=0)
        (mine,) = [p for p in plan.roles if p.layout.role == role]
        weights = sum(hand[k] for k in hand if k not in ("kv", "logits"))
        assert mine.bytes_of("weights") / GB == pytest.approx(weights, rel=0.01)
        over = re.search(rf"- {role}: one rank needs ([\d.]+) GB .* exceeds it by ([\d.]+) GB",
                         message)
        assert over, message
        assert float(over[2]) == pytest.approx(mine.total_bytes / GB - 64, abs=0.01)
        assert f"set {role}.ep: true" in message
    assert "decode: one rank needs 347.56 GB" in message  # 337 GB of weights alone


def test_suggested_ep_figure_is_the_plan_with_ep_on():
    off = load_config(A3, {"decode.ep": False})
    with pytest.raises(MemoryPlanError, match=r"set decode.ep: true \(61.90 GB per rank, "
                                              r"8 experts each\)"):
        check_memory(off)
    plan, _ = build_memory_plan(load_config(A3))
    assert f"{plan.roles[1].total_bytes / GB:.2f}" == "61.90"


def test_too_many_kv_blocks_suggests_how_many_fit():
    cfg = load_config(A3, {"decode.num_kv_blocks": 4096})
    with pytest.raises(MemoryPlanError) as err:
        check_memory(cfg)
    (most,) = re.findall(r"lower decode.num_kv_blocks from 4096 to <= (\d+)", str(err.value))
    fits = load_config(A3, {"decode.num_kv_blocks": int(most)})
    check_memory(fits)
    with pytest.raises(MemoryPlanError):
        check_memory(load_config(A3, {"decode.num_kv_blocks": int(most) + 1}))


def test_cpu_config_fits_the_shared_ram():
    cfg = load_config(REPO / "configs" / "1p1d.yaml")
    assert check_memory(cfg).startswith("memory plan: fits cpu: this machine's RAM")
    plan, _ = build_memory_plan(cfg)
    assert plan.memory.shared
    assert plan.all_ranks_bytes == sum(p.total_bytes * p.layout.dp * p.layout.tp
                                       for p in plan.roles) < plan.memory.bytes


def test_cpu_ranks_are_checked_together():
    cfg = load_config(REPO / "configs" / "1p1d.yaml", {"cluster.device_memory_gb": 0.1})
    plan, _ = build_memory_plan(cfg)
    assert all(p.total_bytes < 0.1 * GB for p in plan.roles) and plan.all_ranks_bytes > 0.1 * GB
    with pytest.raises(MemoryPlanError) as err:
        check_memory(cfg)
    assert (f"all ranks together need {plan.all_ranks_bytes / GB:.2f} GB but "
            "cluster.device_memory_gb is 0.10 GB") in str(err.value)


@pytest.mark.parametrize("config", ["1p1d.yaml", "colocated.yaml"])
def test_uneven_experts_over_ep_ranks_is_an_error_naming_the_fix(config):
    # NOTE: refused when the config is loaded (orchestrator/config/layout_check.py, the engine's one
    # divisibility check), before any memory is planned
    with pytest.raises(ConfigError, match=r"decode.ep: the expert-parallel size dp\*tp\*cp=3 "
                                          r"does not divide n_routed_experts=8 .* or turn "
                                          r"expert parallelism off"):
        load_config(REPO / "configs" / config, {"decode.ep": True, "decode.dp": 3,
                                                 "decode.tp": 1})


def test_device_memory_defaults_and_override():
    assert device_memory("npu", None).bytes == 64 * GB
    assert device_memory("cuda", None).bytes == 80 * GB
    assert not device_memory("npu", None).shared
    assert device_memory("npu", 96.0).bytes == 96 * GB
    assert device_memory("cpu", None).shared


def test_config_json_is_relative_to_the_yaml_file(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "v3.json").write_text(V3_JSON.read_text())
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /nonexistent/V3, config_json: models/v3.json, "
                    "dtype: bfloat16}\ncluster: {device: npu}\nkv_transfer: {block_size: 128}\n"
                    "prefill: {dp: 2, tp: 16, ep: true}\ndecode: {dp: 8, tp: 4, ep: true}\n")
    monkeypatch.chdir(REPO)
    plan, source = build_memory_plan(load_config(path))
    assert source == str((tmp_path / "models" / "v3.json").resolve())
    assert plan.model.num_hidden_layers == 61


def test_orch_up_refuses_before_anything_starts(tmp_path, capsys, monkeypatch):
    from orchestrator import up
    from orchestrator.cli import main

    def must_not_start(*args, **kwargs):
        raise AssertionError("orch up went on past the memory check")

    monkeypatch.setattr(up, "load_security", must_not_start)
    monkeypatch.setattr(up, "bring_up", must_not_start)
    path = tmp_path / "c.yaml"
    path.write_text(A3.read_text().replace("ep: true", "ep: false").replace(
        "config_json: models/", f"config_json: {V3_JSON.parent.parent}/"))
    assert main(["up", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("orch up: the layout does not fit the device memory:\n- prefill: ")
    assert "exceeds it by 283.56 GB" in err


def test_too_many_step_tokens_suggests_how_many_fit_and_no_tp_that_does_not():
    cfg = load_config(A3, {"prefill.max_num_batched_tokens": 10**8})
    with pytest.raises(MemoryPlanError) as err:
        check_memory(cfg)
    assert "raise prefill.tp" not in str(err.value)  # tp 32 needs 39467 GB: no fix
    (most,) = re.findall(r"lower prefill.max_num_batched_tokens from 100000000 to <= (\d+)",
                         str(err.value))
    check_memory(load_config(A3, {"prefill.max_num_batched_tokens": int(most)}))
    with pytest.raises(MemoryPlanError):
        check_memory(load_config(A3, {"prefill.max_num_batched_tokens": int(most) + 1}))


@pytest.mark.parametrize("patch, words", [
    ({"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
      "indexer_types": ["shared", "full", "full"]}, "the first 'full'"),
    ({"index_topk": 0}, "indexer {'index_n_heads': 16, 'index_head_dim': 32, 'index_topk': 0} "
                        "is invalid"),
    ({"index_topk": None}, "has a field of the wrong type"),
])
def test_a_model_the_engine_refuses_stops_orch_up_before_anything_starts(tmp_path, patch,
                                                                         words):
    """run_up checks the memory plan first: a config.json every rank would refuse at load
    is refused here, before Ray and the rank processes start."""
    from orchestrator.tiny_model import tiny_config_dict

    (tmp_path / "config.json").write_text(json.dumps({**tiny_config_dict(deepseek_v32=True),
                                                      **patch}))
    cfg = load_config(REPO / "configs" / "v32_1p1d.yaml", {"model.path": str(tmp_path)})
    with pytest.raises(UnservableModelError, match=re.escape(words)):
        check_memory(cfg)


def test_cp_prefill_ranks_count_and_no_tp_advice():
    cfg = load_config(REPO / "configs" / "cp_1p1d.yaml")
    plan, _ = build_memory_plan(cfg)
    prefill, decode = plan.roles
    assert (prefill.layout.cp, prefill.layout.ranks, decode.layout.ranks) == (2, 2, 1)
    assert plan.all_ranks_bytes == 2 * prefill.total_bytes + decode.total_bytes
    a3_cp = load_config(A3, {"prefill.tp": 1, "prefill.cp": 16, "prefill.ep": False})
    with pytest.raises(MemoryPlanError) as err:
        check_memory(a3_cp)
    assert "- prefill: one rank needs" in str(err.value)
    assert "raise prefill.tp" not in str(err.value), "cp > 1 needs tp 1"

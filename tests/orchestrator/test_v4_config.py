"""configs/v4_colocated.yaml loads; what DeepSeek-V4 does not serve yet is refused at load with
every key to change (orchestrator/config/v4_check.py)."""

from __future__ import annotations

import re

import pytest
import yaml

from orchestrator.config.errors import ConfigError
from orchestrator.config.load import load_config
from orchestrator.config.layout_check import check_tp_layout
from orchestrator.config.memory_check import build_memory_plan, check_memory
from tests.e2e.harness import REPO

CONFIG = REPO / "configs" / "v4_colocated.yaml"
PD_CONFIG = REPO / "configs" / "v4_1p1d.yaml"


def test_shipped_v4_config_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # NOTE: the tiny config, not made yet
    cfg = load_config(CONFIG)
    assert cfg.model.tiny_arch == "deepseek_v4" and cfg.mode == "colocated"
    assert check_memory(cfg).startswith("memory plan: fits cpu")


def test_unsupported_v4_layouts_are_refused_at_load(tmp_path, monkeypatch):
    """TP and EP are served (PD across tp sizes too); a tp that does not split the tiny
    model's 4 heads / 2 output groups, MTP, the prefix cache are refused naming each key."""
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, {"decode.tp": 8, "decode.prefix_cache": True,
                             "decode.speculative": {}})
    for key in ("decode.tp=8 (it must divide num_attention_heads=4)", "decode.prefix_cache",
                "decode.speculative"):
        assert key in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(PD_CONFIG, {"prefill.tp": 2, "prefill.prefix_cache": True,
                                "decode.tp": 3, "decode.ep": True})
    for key in ("prefill.prefix_cache", "decode.tp=3 (it must divide "
                "num_attention_heads=4", "o_groups=2 (or be a multiple of it))"):
        assert key in str(err.value)
    assert "prefill.tp" not in str(err.value) and "decode.ep" not in str(err.value)
    for p_tp, d_tp in ((2, 1), (1, 2), (4, 4)):
        cfg = load_config(PD_CONFIG, {"prefill.tp": p_tp, "decode.tp": d_tp})
        assert {i.role: i.parallel.tp for i in cfg.instances()} == {"prefill": p_tp,
                                                                    "decode": d_tp}


def test_v4_pd_config_loads_and_colocated_prefill_keys_are_chunking_only(tmp_path,
                                                                         monkeypatch):
    """configs/v4_1p1d.yaml loads (PD tp 1 -> tp 1); in colocated mode the prefill section
    gives only the chunking, as for every colocated config (configs/colocated.yaml): its
    tp / prefix_cache are not read, so they are not refused there."""
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    cfg = load_config(PD_CONFIG)
    assert cfg.mode == "disaggregated" and cfg.model.tiny_arch == "deepseek_v4"
    colocated = load_config(CONFIG, {"prefill.tp": 2, "prefill.prefix_cache": True,
                                     "prefill.chunk_size": 32})
    (inst,) = colocated.instances()
    assert inst.parallel.tp == 1 and inst.scheduler.chunk_size == 32
    assert not inst.scheduler.prefix_cache
    staged = load_config(PD_CONFIG, {"prefill.v4_staging_blocks": 8,
                                     "decode.v4_staging_blocks": 16})
    assert {i.role: i.scheduler.staging_blocks for i in staged.instances()} == {
        "prefill": 8, "decode": 16}
    assert {i.scheduler.staging_blocks for i in cfg.instances()} == {0}  # NOTE: num_kv_blocks


def test_v4_staging_pool_below_one_request_is_refused_at_load(tmp_path, monkeypatch, capsys):
    """A ``v4_staging_blocks`` (either role) below the most staging blocks of any prompt up to
    max_model_len is refused at load and by ``--dry-run``, naming the key and the value needed,
    though the longest prompt alone would fit: the report's case, blocks of 4, decode 2 (a
    30-token prompt takes 3, a 40-token one 2; a 255-token one 4, the most, and a 256-token
    one 3). The value needed loads; colocated does not read the key."""
    from engine.v4.staging import most_staging_blocks  # noqa: PLC0415
    from orchestrator.cli import main  # noqa: PLC0415
    from orchestrator.config.checkpoint import model_config_dict  # noqa: PLC0415
    from engine.v4.config import V4Config  # noqa: PLC0415

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    small = {"kv_transfer.block_size": 4, "prefill.chunk_size": 16, "prefill.num_kv_blocks": 64,
             "decode.num_kv_blocks": 64, "decode.v4_staging_blocks": 2}
    cfg = load_config(PD_CONFIG, {**small, "decode.v4_staging_blocks": None})
    need, tokens = most_staging_blocks(V4Config.from_dict(model_config_dict(cfg.model)[0]),
                                       256, 4)
    assert (need, tokens) == (4, 255)
    with pytest.raises(ConfigError) as err:
        load_config(PD_CONFIG, small)
    assert ("decode.v4_staging_blocks (2) is below 4: a DeepSeek-V4 prompt of 255 tokens "
            "takes 4 staging blocks of kv_transfer.block_size 4") in str(err.value)
    assert "raise each to >= 4" in str(err.value) and "prefill.v4_staging_blocks" not in \
        str(err.value)
    with pytest.raises(ConfigError, match=r"prefill\.v4_staging_blocks \(1\) is below 4; "
                       r"decode\.v4_staging_blocks \(3\) is below 4"):
        load_config(PD_CONFIG, {**small, "prefill.v4_staging_blocks": 1,
                                "decode.v4_staging_blocks": 3})
    assert load_config(PD_CONFIG, {**small, "prefill.v4_staging_blocks": 4,
                                   "decode.v4_staging_blocks": 4})
    assert load_config(CONFIG, {"kv_transfer.block_size": 4, "decode.num_kv_blocks": 64,
                                "decode.v4_staging_blocks": 1}).mode == "colocated"
    copy = tmp_path / "small.yaml"
    data = yaml.safe_load(PD_CONFIG.read_text())
    for key, value in small.items():
        section, name = key.split(".")
        data[section][name] = value
    copy.write_text(yaml.safe_dump(data))
    assert main(["up", str(copy), "--dry-run"]) == 2
    assert "decode.v4_staging_blocks (2) is below 4" in capsys.readouterr().err


def test_v4_dry_run_prints_its_memory_plan_once(tmp_path, monkeypatch, capsys):
    from orchestrator.cli import main  # noqa: PLC0415

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    for config in (CONFIG, PD_CONFIG):
        assert main(["up", str(config), "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "not memory-planned" not in out and out.count("memory plan per rank") == 1, out


def test_v4_expert_parallel_layouts_load_and_plan_per_rank_experts(tmp_path, monkeypatch):
    """configs/v4_ep_colocated.yaml (dp 2, ep) and PD with decode dp 2 ep load; each rank's
    memory plan counts 4 of the 8 routed experts; with tp 2 the EP size is dp x tp (2 of 8
    experts a rank), as V3's; an EP size that does not divide 8 is refused naming the key and
    the sizes that do."""
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    cfg = load_config(REPO / "configs" / "v4_ep_colocated.yaml")
    assert [(i.parallel.dp, i.parallel.dp_rank, i.parallel.ep) for i in cfg.instances()] == [
        (2, 0, True), (2, 1, True)]
    assert check_tp_layout(cfg).startswith(
        "tp layout: DeepSeek-V4, decode.tp=1 (ep over dp x tp = 2)")
    plan, _ = build_memory_plan(cfg)
    rows = {r.kind: r for r in plan.roles[0].rows}
    assert rows["routed experts"].split == "4 of 8 whole (EP 2)"
    pd = load_config(PD_CONFIG, {"decode.dp": 2, "decode.ep": True})
    assert "-> decode.tp=1 (ep over dp x tp = 2) disaggregated" in check_tp_layout(pd)
    both = load_config(REPO / "configs" / "v4_ep_colocated.yaml", {"decode.tp": 2})
    assert "decode.tp=2 (ep over dp x tp = 4) colocated" in check_tp_layout(both)
    plan, _ = build_memory_plan(both)
    assert {r.kind: r for r in plan.roles[0].rows}["routed experts"].split == \
        "2 of 8 whole (EP 4)"
    pd = load_config(PD_CONFIG, {"prefill.dp": 2, "prefill.tp": 2, "prefill.ep": True})
    assert "prefill.tp=2 (ep over dp x tp = 4) -> decode.tp=1 disaggregated" in \
        check_tp_layout(pd)
    with pytest.raises(ConfigError, match=r"decode\.ep: the expert-parallel size dp\*tp\*cp=3 "
                       r"does not divide n_routed_experts=8.*\[1, 2, 4, 8\]"):
        load_config(CONFIG, {"decode.dp": 3, "decode.ep": True})
    with pytest.raises(ConfigError, match=r"decode\.ep: the expert-parallel size dp\*tp\*cp=12 "):
        load_config(CONFIG, {"decode.dp": 3, "decode.tp": 4, "decode.ep": True})


def test_v4_quantized_checkpoints_at_load(tmp_path, monkeypatch):
    """An FP8 block checkpoint loads (dequantized at load, ``model.fp8_storage: dequantize``,
    or kept, ``fp8``), with FP4 routed experts too (``expert_dtype: fp4``, the release); kept
    at a tp whose parts are not whole 128 x 128 blocks (the tiny model's 128 query rows over
    tp 2), FP4 experts without a quantization_config, another expert_dtype and W8A8 are
    refused naming the key and the fix (orchestrator/config/v4_check.py, engine/v4/loader.py
    and engine/v4/stored.py's rules)."""
    import json  # noqa: PLC0415

    from orchestrator.tiny_model_v4 import tiny_v4_config_dict  # noqa: PLC0415

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
           "weight_block_size": [128, 128]}

    def load(extra: dict, **overrides):
        ckpt = tmp_path / f"ckpt{len(list(tmp_path.glob('ckpt*')))}"
        ckpt.mkdir()
        (ckpt / "config.json").write_text(json.dumps(tiny_v4_config_dict() | extra))
        return load_config(CONFIG, {"model.path": str(ckpt),
                                    **overrides})

    for ok in ({"quantization_config": fp8}, {"quantization_config": fp8, "expert_dtype": "fp4"},
               {"quantization_config": fp8 | {"expert_dtype": "fp4"}}):
        assert check_tp_layout(load(ok)).startswith("tp layout: DeepSeek-V4")
        assert check_tp_layout(load(ok, **{"model.fp8_storage": "fp8"})).startswith("tp layout")
    cut = ("decode.tp=2 with model.fp8_storage=fp8: its split cuts quantization blocks, "
           "model.layers.*.self_attn.q_b_proj.weight: pieces of 64 along dim 0, not whole "
           "128-wide blocks")
    for extra, overrides, words in (
            ({"quantization_config": fp8}, {"model.fp8_storage": "fp8", "decode.tp": 2}, cut),
            ({"quantization_config": fp8, "expert_dtype": "fp4"},
             {"model.fp8_storage": "fp8", "decode.tp": 2}, cut),
            ({"expert_dtype": "fp4"}, {}, "expert_dtype is 'fp4' without a quantization_config"),
            ({"quantization_config": fp8, "expert_dtype": "int4"}, {}, "expert_dtype is 'int4'"),
            ({"quantization_config": {"quant_method": "compressed-tensors"}}, {},
             "quantization_config")):
        with pytest.raises(ConfigError, match=re.escape(words)):
            load(extra, **overrides)

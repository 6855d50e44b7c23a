"""The parallel layout checked against the checkpoint's config.json when the config loads
(orchestrator/config/layout_check.py, the engine's own split rules): a tp, EP size or layer
sharding the model cannot take is a config error naming the key; EP and CP ranks get their
places."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.config.errors import ConfigError
from orchestrator.config.load import load_config
from tests.orchestrator.test_config_errors import _error


def _checkpoint(tmp_path, **sizes) -> Path:
    """A checkpoint folder whose config.json is the tiny config with ``sizes`` changed."""
    import json

    from orchestrator.tiny_model import tiny_config_dict

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**tiny_config_dict(), **sizes}))
    return tmp_path / "ckpt"


@pytest.mark.parametrize("sizes, layout, expected", [
    ({}, "prefill: {tp: 3}", "prefill.tp: tp=3 does not divide num_attention_heads=4 of the "
                             "checkpoint's config.json: use a tp that divides it (tp sizes "
                             "that divide every split size: [1, 2, 4])"),
    ({"num_attention_heads": 6}, "decode: {tp: 4}", "decode.tp: tp=4 does not divide "
                                                    "num_attention_heads=6"),
    ({"num_attention_heads": 8, "intermediate_size": 12}, "decode: {tp: 8}",
     "decode.tp: tp=8 does not divide intermediate_size=12"),
    ({"num_attention_heads": 8, "moe_intermediate_size": 36}, "prefill: {tp: 8}",
     "prefill.tp: tp=8 does not divide moe_intermediate_size=36"),
])
def test_tp_that_does_not_fit_the_checkpoint_is_a_config_error(tmp_path, sizes, layout,
                                                               expected):
    ckpt = _checkpoint(tmp_path, **sizes)
    msg = _error(tmp_path, f"model: {{path: {ckpt}}}\n{layout}\ncluster: {{device: cpu}}")
    assert expected in msg and str(ckpt / "config.json") in msg


def test_tp_is_checked_against_the_tiny_config_before_it_exists(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    assert "prefill.tp: tp=3 does not divide num_attention_heads=4" in _error(
        tmp_path, "prefill: {tp: 3}\ncluster: {device: cpu}")
    path = tmp_path / "bad.yaml"
    assert main(["up", "--dry-run", str(path)]) == 2
    assert "- prefill.tp: tp=3 does not divide num_attention_heads=4" in capsys.readouterr().err
    path.write_text("prefill: {tp: 4}\ndecode: {tp: 2}\ncluster: {device: cpu}")
    assert main(["up", "--dry-run", str(path)]) == 0
    assert ("tp layout: prefill.tp=4, decode.tp=2 fit the model (the built-in tiny config; not "
            f"created yet at {tmp_path / 'tiny-0'})") in capsys.readouterr().out
    assert not (tmp_path / "tiny-0").exists()


def test_colocated_checks_only_the_decode_tp(tmp_path):
    ckpt = _checkpoint(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {ckpt}}}\nmode: colocated\nprefill: {{tp: 3}}\n"
                    "cluster: {device: cpu}")
    assert load_config(path).prefill.tp == 3  # unused in colocated mode
    path.write_text(f"model: {{path: {ckpt}}}\nmode: colocated\ndecode: {{tp: 3}}\n"
                    "cluster: {device: cpu}")
    with pytest.raises(ConfigError, match="decode.tp: tp=3 does not divide"):
        load_config(path)


@pytest.mark.parametrize("layout, expected", [
    ("decode: {dp: 1, tp: 1, ep: true}", "decode.ep is on but decode.dp x decode.tp = 1"),
    ("prefill: {dp: 3, tp: 1, ep: true}",
     "prefill.ep: the expert-parallel size dp*tp*cp=3 does not divide n_routed_experts=8 of "
     "the checkpoint's config.json: choose dp, tp and cp (prefill only) whose product is one "
     "of [1, 2, 4, 8], or turn expert parallelism off"),
    ("prefill: {dp: 1, cp: 3, ep: true}", "prefill.ep: the expert-parallel size dp*tp*cp=3"),
    ("decode: {dp: 2, tp: 3, ep: true}", "decode.tp: tp=3 does not divide"),
])
def test_expert_parallel_layout_errors_name_the_key_before_anything_starts(tmp_path, layout,
                                                                           expected):
    ckpt = _checkpoint(tmp_path)
    assert expected in _error(tmp_path, f"model: {{path: {ckpt}}}\n{layout}\n"
                                        "cluster: {device: cpu}")


def test_expert_parallel_roles_give_each_instance_its_dp_rank(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    path = tmp_path / "ep.yaml"
    path.write_text(f"model: {{path: {ckpt}}}\nprefill: {{tp: 2, ep: true}}\n"
                    "decode: {dp: 2, ep: true}\ncluster: {device: cpu}")
    cfg = load_config(path)
    layouts = [(i.name, i.parallel.dp_rank, i.parallel.ep_size,
                i.parallel.ep_rank(i.parallel.tp - 1))
               for i in cfg.instances()]
    assert layouts == [("prefill-0", 0, 2, 1), ("decode-0", 0, 2, 0), ("decode-1", 1, 2, 1)]
    assert main(["up", "--dry-run", str(path)]) == 0
    assert ("tp layout: prefill.tp=2 (ep over dp x tp = 2), decode.tp=1 (ep over dp x tp = 2) "
            "fit the model") in capsys.readouterr().out


def test_layer_sharding_of_a_linear_the_model_lacks_is_a_config_error(tmp_path):
    ckpt = _checkpoint(tmp_path, q_lora_rank=None)
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {ckpt}}}\ncluster: {{device: cpu}}\n"
                    "prefill: {cp: 2, layer_sharding: [q_proj, q_b_proj]}\n")
    with pytest.raises(ConfigError, match=r"prefill.layer_sharding: the model has no "
                                          r"\['q_b_proj'\] \(q_lora_rank=None\)"):
        load_config(path)


def test_cp_prefill_with_ep_splits_experts_over_every_cp_rank(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cluster: {device: cpu}\nprefill: {dp: 2, cp: 2, ep: true}\n")
    cfg = load_config(path)
    prefill = [i.parallel for i in cfg.instances() if i.role == "prefill"]
    assert [(p.ranks, p.ep_size) for p in prefill] == [(2, 4), (2, 4)]
    assert [p.ep_rank(r) for p in prefill for r in range(p.ranks)] == [0, 1, 2, 3]

"""Config errors: each names the key path and the fix, all are reported together, and `orch up`
exits 2 on them (a model config.json the engine cannot read or serve included) before anything
starts."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import main
from orchestrator.config.errors import ConfigError
from orchestrator.config.load import load_config


def _error(tmp_path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    return str(err.value)


@pytest.mark.parametrize("text, expected", [
    ("prefill: {tpp: 2}", "prefill.tpp: unknown key; allowed keys here: dp, tp, cp, "
                          "layer_sharding, chunk_size, max_num_batched_tokens, num_kv_blocks"),
    ("routr: {}", "routr: unknown key; allowed keys here: model, mode, prefill, decode"),
    ("prefill: {tp: two}", "prefill.tp: expected an integer, got 'two'"),
    ("kv_transfer: {connect_timeout_s: soon}", "kv_transfer.connect_timeout_s: expected a number"),
    ("router: {policy: random}", "router.policy: must be one of 'round_robin', "
                                 "'least_outstanding_tokens' or 'kv_aware', got 'random'"),
    ("kv_transfer: {backend: mpi}", "kv_transfer.backend: must be one of 'auto', 'hccl', "
                                    "'nccl' or 'gloo', got 'mpi'"),
    ("mode: both", "mode: must be one of 'disaggregated' or 'colocated'"),
    ("decode: {tp: 0}", "decode.tp: must be >= 1, got 0"),
    ("kv_transfer: {block_size: 0}", "kv_transfer.block_size: must be > 0, got 0"),
    ("cluster: {cpus_per_rank: 0}", "cluster.cpus_per_rank: must be > 0"),
    ("model: [1]", "model: expected a mapping (a YAML section)"),
    ("prefill: {chunk_size: 4096, max_num_batched_tokens: 1024}",
     "prefill.chunk_size (4096) must be <= prefill.max_num_batched_tokens (1024)"),
    ("kv_transfer: {backend: hccl}\ncluster: {device: cpu}",
     "kv_transfer.backend 'hccl' does not work with cluster.device 'cpu': use backend 'gloo'"),
    ("kv_transfer: {backend: nccl}\ncluster: {device: npu}", "use backend 'hccl'"),
    ("decode: {num_kv_blocks: 4}\ncluster: {device: cpu}",
     "decode.num_kv_blocks (4) x kv_transfer.block_size (16) = 64 tokens < model.max_model_len "
     "(2048): one request could never fit; raise decode.num_kv_blocks to >= 128"),
    ("router: {port: 9000, metrics_port: 9000}", "router.metrics_port (9000) equals router.port"),
    ("prefill: {cp: 2, tp: 2}", "prefill.cp (2) > 1 needs prefill.tp == 1, got 2"),
    ("prefill: {layer_sharding: [o_proj]}", "prefill.layer_sharding ['o_proj'] needs "
                                            "prefill.cp > 1"),
    ("prefill: {cp: 2, layer_sharding: [o_proj, gate_proj]}",
     "prefill.layer_sharding names ['gate_proj'], which are not attention linears"),
    ("prefill: {cp: 2, layer_sharding: [o_proj, q_b_proj, o_proj]}",
     "prefill.layer_sharding names ['o_proj'] more than once"),
    ("decode: {cp: 2}", "decode.cp: unknown key"),
    ("cluster: {accelerators_per_rank: 2}", "cluster.accelerators_per_rank"),
    ("mode: colocated\nprefill: {cp: 2}", "prefill.cp (2) is for disaggregated prefill"),
    ("prefill: [", "not valid YAML at line"),
    ("- a\n- b", "the top level must be a mapping"),
])
def test_errors_name_key_and_fix(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


def test_all_errors_reported_together(tmp_path):
    msg = _error(tmp_path, "prefill: {tp: 0, dp: x}\nrouter: {policy: z}")
    assert "prefill.tp" in msg and "prefill.dp" in msg and "router.policy" in msg


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_cli_up_bad_config_exits_2(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("prefill: {tp: -1}")
    assert main(["up", "--dry-run", str(path)]) == 2
    assert "prefill.tp: must be >= 1, got -1" in capsys.readouterr().err


def test_dry_run_refuses_a_model_config_the_engine_cannot_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3, "vocab_size": 10}')
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {tmp_path}}}\nprefill: {{tp: 3}}\ncluster: {{device: cpu}}")
    assert main(["up", "--dry-run", str(path)]) == 2
    assert (f"orch up: {tmp_path / 'config.json'}: config.json field 'architectures' is None; "
            "supported values:") in capsys.readouterr().err


def test_unsupported_quantization_is_refused_before_anything_starts(tmp_path, capsys):
    from orchestrator.tiny_model import tiny_config_dict

    raw = {**tiny_config_dict(), "quantization_config": {"quant_method": "awq", "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {tmp_path}}}\ncluster: {{device: cpu}}")
    assert main(["up", "--dry-run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.path: config.json quantization_config.quant_method is 'awq'" in err
    assert "orch model quantize" in err

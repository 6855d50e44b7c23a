"""Config: shipped files validate and dry-run; each error names the key path and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from kv_transfer.config import TransferConfig
from orchestrator.cli import main
from engine.platform import Platform
from orchestrator.config.schema import OrchConfig
from orchestrator.config.errors import ConfigError
from orchestrator.config.load import load_config
from rank.config import SchedulerConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_all_shipped_configs_are_present():
    assert {p.name for p in CONFIGS} >= {"1p1d.yaml", "colocated.yaml", "a3_p2x16_d8x4.yaml",
                                         "gpu_p4x8_d8x4.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates_and_dry_runs(path, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))  # no tiny checkpoint exists there
    cfg = load_config(path)
    assert main(["up", "--dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    for inst in cfg.instances():
        cp = f", cp={inst.parallel.cp}" if inst.parallel.cp > 1 else ""
        assert f"{inst.name}: tp={inst.parallel.tp}{cp}, placement group STRICT_PACK" in out
    assert not (tmp_path / "tiny-0").exists()  # dry-run creates nothing


def test_a3_layout():
    cfg = load_config(next(p for p in CONFIGS if p.name == "a3_p2x16_d8x4.yaml"))
    names = [(i.name, i.parallel.tp, i.parallel.dist_backend, i.parallel.device)
             for i in cfg.instances()]
    assert names == [(f"prefill-{i}", 16, "hccl", "npu") for i in range(2)] + \
                    [(f"decode-{i}", 4, "hccl", "npu") for i in range(8)]
    assert {i.scheduler.block_size for i in cfg.instances()} == {128}
    assert {i.transfer for i in cfg.instances()} == {TransferConfig(
        connect_timeout_s=120, header_timeout_s=60, payload_timeout_s=300,
        completion_timeout_s=cfg.kv_transfer.completion_timeout_s)}
    assert cfg.model.dtype == "bfloat16"


def test_dry_run_report_lines(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /nonexistent/DeepSeek-V3}\ncluster: {device: cpu, "
                    "cpus_per_rank: 0.25}\ndecode: {tp: 2}\n")
    assert main(["up", "--dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "decode-0: tp=2, placement group STRICT_PACK with 2 bundle(s) of {'CPU': 0.25}" in out
    assert "total: 2 instance(s), 3 rank(s), resources {'CPU': 0.75}" in out
    assert "  ranks: rank0 (leader), rank1; one Ray actor per rank" in out  # not rank1..rank1
    assert "layers: 61 (/nonexistent/DeepSeek-V3/config.json not found: assuming DeepSeek-V3" in out


def test_ranks_can_share_one_gpu(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /nonexistent/DeepSeek-V3}\ncluster: {device: cuda, "
                    "cpus_per_rank: 1, accelerators_per_rank: 0.5}\n"
                    "kv_transfer: {backend: nccl}\n")
    assert main(["up", "--dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "prefill-0: tp=1, placement group STRICT_PACK with 1 bundle(s) of " \
           "{'CPU': 1.0, 'GPU': 0.5}" in out
    assert "resources {'CPU': 2.0, 'GPU': 1.0}" in out


def test_dry_run_reads_layers_from_checkpoint(tmp_path, capsys):
    from orchestrator.tiny_model import tiny_config_dict

    (tmp_path / "config.json").write_text(json.dumps({**tiny_config_dict(),
                                                      "num_hidden_layers": 5}))
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {tmp_path}}}\ncluster: {{device: cpu}}\n")
    assert main(["up", "--dry-run", str(path)]) == 0
    assert f"layers: 5 (num_hidden_layers from {tmp_path / 'config.json'})" in \
        capsys.readouterr().out


SECTIONS = {"prefill": {"chunk_size": 32, "max_num_batched_tokens": 96, "max_num_seqs": 3,
                        "num_kv_blocks": 200},
            "decode": {"max_num_seqs": 7, "num_kv_blocks": 300},
            "kv_transfer": {"block_size": 16}, "cluster": {"device": "cpu"},
            "model": {"max_model_len": 1000}}  # NOTE: every role's (sizes V4's group pools)


def test_each_role_schedules_with_its_own_section():
    prefill, decode = OrchConfig.model_validate(SECTIONS).instances()
    assert prefill.scheduler == SchedulerConfig(block_size=16, num_kv_blocks=200, chunk_size=32,
                                                max_num_batched_tokens=96, max_num_seqs=3,
                                                max_model_len=1000)
    # decode computes one token per running request: prefill's chunking is not its business
    assert decode.scheduler == SchedulerConfig(block_size=16, num_kv_blocks=300, chunk_size=1,
                                               max_num_batched_tokens=7, max_num_seqs=7,
                                               max_model_len=1000)
    assert decode.scheduler.v4_shape == (7, 1000, 1) and prefill.scheduler.v4_shape == \
        (3, 1000, 32)


def test_colocated_chunks_like_prefill_and_batches_like_decode():
    (inst,) = OrchConfig.model_validate({**SECTIONS, "mode": "colocated"}).instances()
    assert inst.scheduler == SchedulerConfig(block_size=16, num_kv_blocks=300, chunk_size=32,
                                             max_num_batched_tokens=96, max_num_seqs=7,
                                             max_model_len=1000)


def test_transfer_waits_are_the_one_transfer_config():
    default = OrchConfig.model_validate({"cluster": {"device": "cpu"}})
    assert default.kv_transfer.transfer_config() == TransferConfig()
    assert {i.transfer for i in default.instances()} == {TransferConfig()}
    cfg = OrchConfig.model_validate({"cluster": {"device": "cpu"},
                                     "kv_transfer": {"payload_timeout_s": 7.5}})
    assert {i.transfer for i in cfg.instances()} == {TransferConfig(payload_timeout_s=7.5)}
    off = OrchConfig.model_validate({"cluster": {"device": "cpu"},
                                     "kv_transfer": {"same_node": "off"}})
    assert {i.transfer.same_node for i in off.instances()} == {"off"}
    with pytest.raises(ValidationError, match="same_node"):
        OrchConfig.model_validate({"kv_transfer": {"same_node": "shm"}})
    with pytest.raises(ValueError, match="same_node"):
        TransferConfig(same_node="on")


def test_step_timeout_reaches_every_instance():
    cfg = OrchConfig.model_validate({"cluster": {"device": "cpu"},
                                     "health": {"step_timeout_s": 45}})
    assert {i.parallel.step_timeout_s for i in cfg.instances()} == {45.0}
    with pytest.raises(ValidationError, match="step_timeout_s"):
        OrchConfig.model_validate({"health": {"step_timeout_s": 0}})


def test_auto_device_is_engine_platforms_decision(monkeypatch):
    monkeypatch.setenv("ORCH_DEVICE", "cuda")  # engine.platform honours it; no GPU needed
    cfg = OrchConfig.model_validate({})
    assert cfg.platform() == Platform("cuda", "nccl")
    assert {(i.parallel.device, i.parallel.dist_backend) for i in cfg.instances()} == \
        {("cuda", "nccl")}


def test_instances_colocated():
    cfg = OrchConfig.model_validate({"mode": "colocated", "decode": {"dp": 2, "tp": 1},
                                     "cluster": {"device": "cpu"}})
    assert [(i.name, i.role) for i in cfg.instances()] == [("colocated-0", "colocated"),
                                                           ("colocated-1", "colocated")]


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


@pytest.mark.parametrize("section,field,value", [("prefill", "tp", 4), (None, "mode", "colocated")])
def test_frozen(section, field, value):
    cfg = OrchConfig.model_validate({"cluster": {"device": "cpu"}})
    target = getattr(cfg, section) if section else cfg
    before = getattr(target, field)
    with pytest.raises(ValidationError) as err:
        setattr(target, field, value)
    assert [e["type"] for e in err.value.errors()] == ["frozen_instance"]
    assert getattr(target, field) == before != value


class _Pair:
    def __init__(self, p, d, layers):
        self.prefill_rank, self.decode_rank, self.layers = p, d, tuple(layers)


def test_dry_run_prints_the_transfer_plan(tmp_path, capsys, monkeypatch):
    import sys
    import types

    calls = []

    def build_transfer_plan(prefill_tp, decode_tp, num_layers, kind="mla", prefill_cp=1):
        calls.append((prefill_tp, decode_tp, num_layers, kind, prefill_cp))
        return types.SimpleNamespace(pairs=[_Pair(0, 0, range(61)), _Pair(0, 1, [0, 1, 2, 7])])

    fake = types.ModuleType("kv_transfer.plan")
    fake.build_transfer_plan = build_transfer_plan
    monkeypatch.setitem(sys.modules, "kv_transfer.plan", fake)
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /nonexistent/DeepSeek-V3}\ncluster: {device: cpu}\n"
                    "prefill: {dp: 2}\ndecode: {tp: 2}\n")
    assert main(["up", "--dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    assert calls == [(1, 2, 61, "mla", 1)]
    assert ("transfer plan P1 -> D2 (MLA), used by 2 instance pair(s): prefill-0->decode-0, "
            "prefill-1->decode-0") in out
    assert "  prefill rank 0 -> decode rank 0: 61 layer(s) 0-60\n" in out
    assert "  prefill rank 0 -> decode rank 1: 4 layer(s) 0-2,7\n" in out


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


def test_each_tiny_arch_has_its_own_checkpoint_folder(tmp_path, monkeypatch):
    """A V3.2 config never loads a V3 tiny checkpoint made earlier in the same cache."""
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    v3 = OrchConfig.model_validate({"model": {"tiny_seed": 2}}).model
    v32 = OrchConfig.model_validate({"model": {"tiny_seed": 2, "tiny_arch": "deepseek_v32"}})
    assert v3.checkpoint_dir() == tmp_path / "tiny-2"
    assert v32.model.checkpoint_dir() == tmp_path / "tiny-deepseek_v32-2"


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


def test_dry_run_refuses_a_model_config_the_engine_cannot_read(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3, "vocab_size": 10}')
    path = tmp_path / "c.yaml"
    path.write_text(f"model: {{path: {tmp_path}}}\nprefill: {{tp: 3}}\ncluster: {{device: cpu}}")
    assert main(["up", "--dry-run", str(path)]) == 2
    assert (f"orch up: {tmp_path / 'config.json'}: config.json field 'architectures' is None; "
            "supported values:") in capsys.readouterr().err


def test_kv_transfer_heartbeats_must_fit_the_peer_timeout():
    with pytest.raises(ValidationError, match=r"peer_timeout_s \(6.0\) must be > 2 x "
                                              r"heartbeat_s \(5.0\)"):
        OrchConfig.model_validate({"kv_transfer": {"heartbeat_s": 5.0, "peer_timeout_s": 6.0}})
    cfg = OrchConfig.model_validate({"kv_transfer": {"heartbeat_s": 2.0, "peer_timeout_s": 9.0}})
    assert cfg.kv_transfer.transfer_config().peer_timeout_s == 9.0


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


def test_router_replicas_default_to_one_and_refuse_autoscale():
    assert OrchConfig().router.replicas == 1
    assert OrchConfig.model_validate({"router": {"replicas": 4}}).router.replicas == 4
    with pytest.raises(ValidationError, match="router.replicas to 1"):
        OrchConfig.model_validate({"router": {"replicas": 2},
                                   "autoscale": {"ttft_p90_s": 1.0, "tpot_p90_s": 0.1}})
    with pytest.raises(ValidationError):
        OrchConfig.model_validate({"router": {"replicas": 0}})

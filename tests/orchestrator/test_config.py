"""Config: the shipped files are there, and each section reaches the instances it sizes (their
scheduler, transfer, health and device settings); the models are frozen."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.platform import Platform
from kv_transfer.config import TransferConfig
from orchestrator.config.load import load_config
from orchestrator.config.schema import OrchConfig
from rank.config import SchedulerConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_all_shipped_configs_are_present():
    assert {p.name for p in CONFIGS} >= {"1p1d.yaml", "colocated.yaml", "a3_p2x16_d8x4.yaml",
                                         "gpu_p4x8_d8x4.yaml"}


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


def test_kv_transfer_heartbeats_must_fit_the_peer_timeout():
    with pytest.raises(ValidationError, match=r"peer_timeout_s \(6.0\) must be > 2 x "
                                              r"heartbeat_s \(5.0\)"):
        OrchConfig.model_validate({"kv_transfer": {"heartbeat_s": 5.0, "peer_timeout_s": 6.0}})
    cfg = OrchConfig.model_validate({"kv_transfer": {"heartbeat_s": 2.0, "peer_timeout_s": 9.0}})
    assert cfg.kv_transfer.transfer_config().peer_timeout_s == 9.0


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


@pytest.mark.parametrize("section,field,value", [("prefill", "tp", 4), (None, "mode", "colocated")])
def test_frozen(section, field, value):
    cfg = OrchConfig.model_validate({"cluster": {"device": "cpu"}})
    target = getattr(cfg, section) if section else cfg
    before = getattr(target, field)
    with pytest.raises(ValidationError) as err:
        setattr(target, field, value)
    assert [e["type"] for e in err.value.errors()] == ["frozen_instance"]
    assert getattr(target, field) == before != value


def test_each_tiny_arch_has_its_own_checkpoint_folder(tmp_path, monkeypatch):
    """A V3.2 config never loads a V3 tiny checkpoint made earlier in the same cache."""
    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    v3 = OrchConfig.model_validate({"model": {"tiny_seed": 2}}).model
    v32 = OrchConfig.model_validate({"model": {"tiny_seed": 2, "tiny_arch": "deepseek_v32"}})
    assert v3.checkpoint_dir() == tmp_path / "tiny-2"
    assert v32.model.checkpoint_dir() == tmp_path / "tiny-deepseek_v32-2"


def test_router_replicas_default_to_one_and_refuse_autoscale():
    assert OrchConfig().router.replicas == 1
    assert OrchConfig.model_validate({"router": {"replicas": 4}}).router.replicas == 4
    with pytest.raises(ValidationError, match="router.replicas to 1"):
        OrchConfig.model_validate({"router": {"replicas": 2},
                                   "autoscale": {"ttft_p90_s": 1.0, "tpot_p90_s": 0.1}})
    with pytest.raises(ValidationError):
        OrchConfig.model_validate({"router": {"replicas": 0}})


def test_max_model_len_above_the_models_positions_is_refused(tmp_path, monkeypatch, capsys):
    """As vLLM: a max_model_len above config.json's max_position_embeddings is refused at load
    and by --dry-run naming both numbers and the fix (the tiny V3: 4096, the tiny V4: 256),
    unless ORCH_ALLOW_LONG_MAX_MODEL_LEN=1; never for DeepSeek-V4, whose runner refuses any
    step past it. The limit itself loads."""
    from orchestrator.cli import main  # noqa: PLC0415
    from orchestrator.config.errors import ConfigError  # noqa: PLC0415

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    v3 = next(p for p in CONFIGS if p.name == "1p1d.yaml")
    v4 = next(p for p in CONFIGS if p.name == "v4_1p1d.yaml")
    long_v3 = {"model.max_model_len": 8192, "prefill.num_kv_blocks": 512,
               "decode.num_kv_blocks": 512}
    with pytest.raises(ConfigError, match=r"model\.max_model_len \(8192\) is above the model's "
                       r"max_position_embeddings \(4096, .*\): lower model\.max_model_len to "
                       r"<= 4096, or set ORCH_ALLOW_LONG_MAX_MODEL_LEN=1"):
        load_config(v3, long_v3)
    assert load_config(v3, {**long_v3, "model.max_model_len": 4096})
    with pytest.raises(ConfigError, match=r"model\.max_model_len \(1024\) is above the model's "
                       r"max_position_embeddings \(256, .*<= 256; DeepSeek-V4 serves no "):
        load_config(v4, {"model.max_model_len": 1024})
    copy = tmp_path / "long.yaml"
    copy.write_text(v4.read_text().replace("max_model_len: 256 ", "max_model_len: 1024"))
    assert main(["up", str(copy), "--dry-run"]) == 2
    assert "max_model_len (1024) is above" in capsys.readouterr().err
    monkeypatch.setenv("ORCH_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert load_config(v3, long_v3).model.max_model_len == 8192
    with pytest.raises(ConfigError, match="DeepSeek-V4 serves no position past it"):
        load_config(v4, {"model.max_model_len": 1024})
    monkeypatch.setenv("ORCH_ALLOW_LONG_MAX_MODEL_LEN", "yes")
    with pytest.raises(ConfigError, match="ORCH_ALLOW_LONG_MAX_MODEL_LEN='yes' is invalid"):
        load_config(v3, long_v3)

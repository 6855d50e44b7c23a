"""orchestrator.planner without Ray or devices: FLOP counts against DeepSeek-V3's published
active parameters, sparse attention counts against brute force, the load model against
Little's law, the workload option, and the one device data file."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from engine.model_config import ModelConfig
from orchestrator.config.devices import GB, device_memory
from orchestrator.planner.counts import attention_flops, linear_params_per_token, sum_min
from orchestrator.planner.load import Roles, WorkloadSpec, operating_point, parse_workload
from orchestrator.planner.specs import DEVICES_FILE, default_device, device_table
from tests.e2e.harness import REPO


def _model(name: str) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(
        (REPO / "configs" / "models" / name / "config.json").read_text()))


def test_active_parameters_are_deepseek_v3s_37b():
    m = _model("deepseek-v3")
    with_vocab = linear_params_per_token(m) + 2 * m.vocab_size * m.hidden_size
    assert with_vocab == pytest.approx(37e9, rel=0.03)  # "37B activated" (DeepSeek-V3 report)


@pytest.mark.parametrize("past, new, k", [(0, 10, 4), (3, 10, 20), (30, 5, 4), (0, 1, 4),
                                          (4, 4, 4)])
def test_sum_min_is_brute_force(past, new, k):
    assert sum_min(past, new, k) == sum(min(t, k) for t in range(past + 1, past + new + 1))


def test_sparse_attention_counts_topk_keys_and_the_indexer_over_all():
    v32 = _model("deepseek-v32")
    n = 65536
    dense = attention_flops(_model("deepseek-v3"), n, 0)
    sparse = attention_flops(v32, n, 0)
    indexer = 2.0 * v32.num_hidden_layers * v32.index_n_heads * v32.index_head_dim \
        * n * (n + 1) / 2
    mla = 2.0 * v32.num_hidden_layers * v32.num_attention_heads \
        * (2 * v32.kv_lora_rank + v32.qk_rope_head_dim) * (n * 2048 - 2048 * 2047 / 2)
    assert sparse == pytest.approx(indexer + mla)
    assert sparse < dense / 2  # the indexer's 64 x 128 per key vs MLA's 128 x (192 + 128)


def test_parse_workload():
    assert parse_workload("in=65536,out=3072") == WorkloadSpec(65536, 3072)
    assert parse_workload("in=8,out=2,rate=0.5").rate == 0.5
    assert parse_workload("in=8,out=2,concurrency=4").concurrency == 4
    assert parse_workload("in=8,out=2,concurrency=4,start=together").together
    assert not parse_workload("in=8,out=2,concurrency=4,start=staggered").together
    for bad in ("in=8", "in=8,out=2,x=1", "in=8,out=2,rate=1,concurrency=2", "in=0,out=2",
                "in=8,out=2,start=together", "in=8,out=2,concurrency=4,start=now",
                "in=8,out=2,rate=0", "in=8,out=2,concurrency=0", "in=8,out=2,rate=nan",
                "in=8,out=2,rate=inf", "in=8,out=2,in=4", "in=abc,out=2"):
        with pytest.raises(ValueError):
            parse_workload(bad)


def _roles(prefill_s: float, slots: int = 4) -> Roles:
    return Roles(prefill_s, 0.5, lambda b: 0.01 + 0.001 * b, 2, 8, slots, False)


def test_lockstep_prompts_queue_one_after_another_then_decode_together():
    # 4 requests start together on one prefill rank (64 ms a prompt) and one decode rank
    r = Roles(0.064, 0.002, lambda b: 0.01 + 0.001 * b, 1, 1, 8, False, 0.003)
    pt = operating_point(r, WorkloadSpec(64, 5, concurrency=4, together=True))
    assert pt.ttft_s == pytest.approx(0.002 + 0.064 * (1 + 2 + 3 + 4) / 4)
    assert pt.tpot_s == pytest.approx(0.014 + 4 * 0.003 / 4)  # batch 4; 4 transfers in turn
    assert pt.decode_batch == 4
    assert pt.requests_s == pytest.approx(4 / (0.002 + 4 * 0.064 + 4 * pt.tpot_s))
    two = operating_point(replace(r, prefill_dp=2), WorkloadSpec(64, 5, concurrency=4,
                                                                 together=True))
    assert two.ttft_s == pytest.approx(0.002 + 0.064 * 1.5)


def test_closed_loop_obeys_littles_law_and_prefill_capacity():
    wl = WorkloadSpec(1000, 100, concurrency=64)
    pt = operating_point(_roles(prefill_s=4.0), wl)
    assert pt.bound == "prefill" and pt.requests_s == pytest.approx(2 / 4.0)
    assert pt.requests_s * (pt.ttft_s + 100 * pt.tpot_s) == pytest.approx(64, rel=1e-6)
    light = operating_point(_roles(prefill_s=0.01), WorkloadSpec(1000, 100, concurrency=1))
    assert light.bound == "load"
    assert light.ttft_s == pytest.approx(0.01 + 0.5)  # no queueing with one in flight


def test_open_loop_over_capacity_says_so():
    pt = operating_point(_roles(prefill_s=4.0), WorkloadSpec(1000, 100, rate=1.0))
    assert math.isinf(pt.ttft_s)
    assert pt.bound == "prefill (overloaded: 1 req/s > capacity 0.5 req/s)"  # 2 ranks, 4 s
    ok = operating_point(_roles(prefill_s=4.0), WorkloadSpec(1000, 100, rate=0.25))
    assert ok.ttft_s == pytest.approx(0.25 * 4.0 / 2 * 4.0 / (2 * (1 - 0.5)) + 4.5)


def test_device_memory_comes_from_the_device_file():
    assert device_memory("npu", None).bytes == default_device("npu").memory_gb * GB == 64 * GB
    assert device_memory("cuda", None).bytes == 80 * GB
    text = DEVICES_FILE.read_text()
    for key, spec in device_table().items():
        assert spec.hbm_gb_s > 0 and spec.bf16_tflops > 0 and spec.inter_domain_gb_s > 0
        entry = text.split(f"\n  {key}:\n")[1].split("\n  h")[0]
        assert entry.count("#") >= 4, f"{key}: each figure needs its source in a comment"


def test_orch_plan_prints_seed_004s_prediction_as_docs_planner_md_says(capsys):
    from orchestrator.cli import main

    assert main(["plan", str(REPO / "configs" / "a3_v32_p2x16_d8x4.yaml"), "--workload",
                 "in=65536,out=3072,concurrency=29"]) == 0
    predicted = [line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("predicted: ")]
    assert len(predicted) == 1
    assert predicted[0] in (REPO / "docs" / "planner.md").read_text()


def test_orch_plan_refuses_a_bad_workload(capsys):
    from orchestrator.cli import main

    assert main(["plan", str(REPO / "configs" / "1p1d.yaml"), "--workload", "in=64"]) == 2
    assert "needs in= and out=" in capsys.readouterr().err


def test_plan_refuses_a_request_longer_than_max_model_len():
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.load import load_config
    from orchestrator.planner.report import plan_config

    cfg = load_config(REPO / "configs" / "colocated.yaml")  # max_model_len 512, KV 1024
    with pytest.raises(ConfigError, match="max_model_len"):
        plan_config(cfg, WorkloadSpec(600, 10), default_device("cuda"))


def test_plan_refuses_a_layout_that_does_not_fit_the_device():
    from orchestrator.config.errors import ConfigError
    from orchestrator.config.load import load_config
    from orchestrator.planner.report import plan_config

    cfg = load_config(REPO / "configs" / "a3_p2x16_d8x4.yaml")  # ~61 GB a rank, 48 ranks
    wl, h100 = WorkloadSpec(64, 16), default_device("cuda")
    assert plan_config(cfg, wl, h100).point.output_tok_s > 0  # 80 GB a rank
    with pytest.raises(ConfigError, match="one rank needs 61.90 GB of 40 GB"):
        plan_config(cfg, wl, replace(h100, memory_gb=40))
    with pytest.raises(ConfigError, match="all ranks together need"):  # cpu: RAM is shared
        plan_config(cfg, wl, replace(h100, platform="cpu", memory_gb=100))


def test_best_split_may_give_prefill_all_the_ranks_it_can_use():
    from orchestrator.config.load import load_config
    from orchestrator.planner.report import plan_config

    cfg = load_config(REPO / "configs" / "cp_1p1d.yaml")  # prefill tp 1 x cp 2, decode tp 1
    plan = plan_config(cfg, WorkloadSpec(64, 16), default_device("cuda"))
    assert plan.best_split[:2] == (1, 1)  # the only split of 3 ranks (was none: dp 0 : 0)


def test_serving_cost_is_paid_once_per_step_and_per_prefill_chunk():
    from orchestrator.config.load import load_config
    from orchestrator.planner.report import plan_config

    base = replace(default_device("cuda"), step_serving_us=0.0)
    slow = replace(base, step_serving_us=1000.0)
    cfg = load_config(REPO / "configs" / "colocated.yaml")
    wl = WorkloadSpec(cfg.prefill.chunk_size + 64, 16, concurrency=1)  # 2 prefill chunks
    fast_pt, slow_pt = (plan_config(cfg, wl, d).point for d in (base, slow))
    assert slow_pt.tpot_s - fast_pt.tpot_s == pytest.approx(1e-3, rel=1e-6)
    assert slow_pt.ttft_s - fast_pt.ttft_s == pytest.approx(2e-3, rel=1e-6)


def test_cpu_collective_latency_is_the_served_tp2_steps_extra_per_collective():
    from orchestrator.planner.calibrate import _collective_latency_us

    from orchestrator.planner.calibrate_serving import ServedSteps

    # 3 layers: 2 x 3 + 2 = 8 collectives; 30 ms over 14 ms served, less a 1.2 ms call
    steps = ServedSteps(0.007, 0.014, 0.030, 0.02, 0.03)
    assert _collective_latency_us(3, steps, 1200.0, 100.0) == pytest.approx(14_800.0 / 8)
    close = ServedSteps(0.007, 0.014, 0.0141, 0.02, 0.03)
    assert _collective_latency_us(3, close, 1200.0, 100.0) == 100.0


def test_cpu_first_token_costs_are_the_served_first_tokens_beyond_the_counted_calls():
    from orchestrator.planner.calibrate import _first_token_us

    # colocated: 1 call; disaggregated: 3 (reserve, the receivers it arms, prefill)
    assert _first_token_us(0.012, True, 1000.0, 0.006, 0.002) == pytest.approx(3000.0)
    assert _first_token_us(0.020, False, 1000.0, 0.006, 0.002) == pytest.approx(9000.0)
    assert _first_token_us(0.005, True, 1000.0, 0.006, 0.002) == 0.0


def test_first_token_cost_of_its_mode_is_paid_once_per_request_in_ttft_only():
    from orchestrator.config.load import load_config
    from orchestrator.planner.report import plan_config

    base = replace(default_device("cuda"), first_token_us=0.0, pd_first_token_us=0.0)
    wl = WorkloadSpec(128, 16, concurrency=1)
    for name, field in (("colocated", "first_token_us"), ("1p1d", "pd_first_token_us")):
        cfg = load_config(REPO / "configs" / f"{name}.yaml")
        other = "pd_first_token_us" if field == "first_token_us" else "first_token_us"
        fast_pt, slow_pt, other_pt = (plan_config(cfg, wl, d).point for d in (
            base, replace(base, **{field: 1000.0}), replace(base, **{other: 1000.0})))
        assert slow_pt.ttft_s - fast_pt.ttft_s == pytest.approx(1e-3, rel=1e-6)
        assert slow_pt.tpot_s == pytest.approx(fast_pt.tpot_s, rel=1e-9)
        assert other_pt.ttft_s == pytest.approx(fast_pt.ttft_s, rel=1e-9)


def test_cpu_calibration_says_what_it_does_and_how_long(tmp_path, monkeypatch, capsys):
    """`orch plan` on a cpu config measures the machine first (15-30 s): it says so, with
    where the figures are cached, instead of staying silent."""
    from orchestrator.planner import calibrate

    monkeypatch.setenv("ORCH_CACHE_DIR", str(tmp_path))
    measured = calibrate.DeviceSpec(
        key="cpu", platform="cpu", name="cpu (measured on this machine)", memory_gb=8.0,
        hbm_gb_s=10.0, bf16_tflops=0.1, int8_tflops=0.1, intra_domain_gb_s=1.0,
        inter_domain_gb_s=1.0, link_latency_us=50.0, domain_ranks=2, layer_overhead_us=0.0)

    def fake_measure(ckpt=None, served=None):
        calibrate.progress("step under test")
        return measured
    monkeypatch.setattr(calibrate, "measure_cpu", fake_measure)
    assert calibrate.cpu_device(recalibrate=True) == measured
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("orch plan: calibrating this machine's CPU (once, about 15-30 s; "
                             f"the figures are cached in {tmp_path}"), err
    assert err[1] == "orch plan: calibrating: step under test"
    assert err[2].startswith("orch plan: calibrated in ")
    assert calibrate.cpu_device() == measured  # cached now: no second measurement
    assert capsys.readouterr().err == ""

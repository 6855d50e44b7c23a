"""DeepSeek-V4's memory plan (orchestrator/config/memory_plan_v4.py) on the tiny V4 config and
the released DeepSeek-V4-Flash config.json, checked by hand and against the engine's modules;
`orch up --dry-run` of seed 004's V4 layout prints the plan once, then V4 serving's refusal."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine.v4.config import V4Config
from engine.v4.model import DeepseekV4ForCausalLM
from orchestrator.cli import main
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import MemoryPlanError, check_memory
from orchestrator.config.role_layout import RoleLayout
from orchestrator.config.memory_plan_v4 import (FP4_BYTES, V4Precision, kv_bytes_per_request,
                                                kv_elements_per_request, plan_role_v4)
from orchestrator.tiny_model_v4 import tiny_v4_config_dict
from tests.e2e.harness import REPO

FLASH = REPO / "configs" / "models" / "deepseek-v4" / "config.json"
A3_V4 = REPO / "configs" / "a3_v4_p2x16_d8x4.yaml"
TINY = V4Config.from_dict(tiny_v4_config_dict())  # sliding, CSA 1/4, HCA 1/16, CSA; window 8


def _layout(**kw) -> RoleLayout:
    base = dict(role="decode", dp=1, tp=1, ep=False, num_kv_blocks=10, block_size=16,
                step_tokens=4, max_num_seqs=3, max_model_len=256)
    return RoleLayout(**{**base, **kw})


def _rows(plan) -> dict[str, int]:
    return {r.kind: r.elements for r in plan.rows}


def test_tiny_request_kv_by_hand():
    # 100 tokens, D 32, index keys 16: window 7 rows x 32 x 4 layers = 896; two CSA layers of
    # 25 entries x (32 + 16) = 2400 and full-group state (100 % 4 = 0: no buffer; overlap 4
    # rows of kv + gate at 32 and at 16) 2 x 384 = 768; HCA 6 entries x 32 = 192 and 4 open
    # rows of kv + gate x 32 = 256.
    parts = kv_elements_per_request(TINY, 100)
    assert parts == {"window": 896, "entries": 2400 + 192, "state": 768 + 256}
    assert kv_bytes_per_request(TINY, 100, 2.0) == 2 * 4512


def test_request_kv_grows_only_by_compressed_entries_past_the_window():
    a, b = kv_elements_per_request(TINY, 64), kv_elements_per_request(TINY, 128)
    assert a["window"] == b["window"] == 7 * 32 * 4 and a["state"] == b["state"]
    # 64 more tokens: 16 entries x 48 in each CSA layer, 4 x 32 in the HCA layer
    assert b["entries"] - a["entries"] == 2 * 16 * 48 + 4 * 32
    flash = V4Config.from_dict(json.loads(FLASH.read_text()))
    short, long = (kv_elements_per_request(flash, n) for n in (65536, 131072))
    assert short["window"] == long["window"] == 127 * 512 * 43


def test_tiny_plan_rows_by_hand():
    plan = plan_role_v4(TINY, _layout(dp=2, tp=2, ep=True), V4Precision.of("bfloat16"))
    rows = _rows(plan)
    # o_a: (2 groups x 16) / tp 2 = 16 rows x (4 heads x 32 / 2) + o_b 64 x 16, 4 layers
    assert rows["grouped output projection"] == 4 * (16 * 64 + 64 * 16)
    assert rows["routed experts"] == 4 * 2 * 3 * 64 * 32  # EP 4: 2 of 8 experts whole
    assert rows["embedding"] == rows["lm_head"] == 129280 // 2 * 64
    # pools (engine/pool_plan.py): a 256-token request at a token a step holds window 2
    # blocks of 16 (7 kept + 1, +1 edge), CSA 64 entries = 4 blocks, HCA 16 = 1: 16 x (2 x
    # 128 + 4 x 96 + 32) = 10,752 elements; the budget, 10 blocks of every group, 10 x 16 x
    # 256 = 40,960, would hold 3.8 of them: max_num_seqs 3 sizes the pools
    assert rows["KV: window"] == 3 * 2 * 16 * 4 * 32
    assert rows["KV: CSA entries 1/4"] == 3 * 4 * 16 * 2 * (32 + 16)
    assert rows["KV: HCA entries 1/16"] == 3 * 1 * 16 * 32
    state = 2 * (2 * 3 * 64 + 2 * 4 * 32 + 2 * 3 * 32 + 2 * 4 * 16) + 2 * 15 * 32
    assert rows["KV: compressor state"] == 3 * state
    # 8 sequences: the budget's 3.8 requests, floor(3.8 x blocks) each, state ceil(3.8)
    rows = _rows(plan_role_v4(TINY, _layout(max_num_seqs=8), V4Precision.of("bfloat16")))
    assert rows["KV: window"] == 7 * 16 * 4 * 32  # 40,960 x 2 // 10,752
    assert rows["KV: CSA entries 1/4"] == 15 * 16 * 2 * (32 + 16)  # 40,960 x 4 // 10,752
    assert rows["KV: HCA entries 1/16"] == 3 * 16 * 32
    assert rows["KV: compressor state"] == 4 * state
    assert rows["hash router tid2eid"] == 2 * 129280 * 2


def test_plan_counts_what_the_engine_builds():
    """Weights at tp 1 equal the parameters (+ router bias buffers) of engine/v4's model; the
    released Flash config gives DeepSeek's 284B (its MTP layer apart)."""
    for cfg in (TINY, V4Config.from_dict(json.loads(FLASH.read_text()))):
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(cfg)
        bias = sum(b.numel() for n, b in model.named_buffers()
                   if n.endswith("e_score_correction_bias"))
        rows = _rows(plan_role_v4(cfg, _layout(), V4Precision.of("bfloat16")))
        weights = sum(n for k, n in rows.items() if not k.startswith(("KV", "workspace"))
                      and k != "hash router tid2eid")
        assert weights == sum(p.numel() for p in model.parameters()) + bias
    assert round(weights / 1e9) == 284


def test_plan_at_tp_counts_one_rank_of_the_engine():
    """At tp 2 and 4 (ep off) the weight rows equal the parameters of engine/v4's rank-0 model
    (engine/v4/tp.py: query heads, output groups, experts' intermediate and vocab split; the
    tiny config's 2 output groups: one each at tp 2, shared by two ranks at tp 4; Flash's 8:
    4 and 2 each, 1/2 of one at tp 16); a tp that o_groups neither divides nor is divided by
    is refused naming it."""
    from engine.parallel import TPGroup  # noqa: PLC0415

    flash = V4Config.from_dict(json.loads(FLASH.read_text()))
    for cfg, tp in ((TINY, 2), (TINY, 4), (flash, 2), (flash, 4), (flash, 16)):
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(cfg, TPGroup(rank=0, size=tp))
        bias = sum(b.numel() for n, b in model.named_buffers()
                   if n.endswith("e_score_correction_bias"))
        rows = _rows(plan_role_v4(cfg, _layout(tp=tp), V4Precision.of("bfloat16")))
        weights = sum(n for k, n in rows.items() if not k.startswith(("KV", "workspace"))
                      and k != "hash router tid2eid")
        assert weights == sum(p.numel() for p in model.parameters()) + bias, (tp, cfg.o_groups)
    odd = V4Config(**{**TINY.__dict__, "o_groups": 3, "num_attention_heads": 12})
    with pytest.raises(ValueError, match=r"tp 2 and DeepSeek-V4's o_groups \(3\)"):
        plan_role_v4(odd, _layout(tp=2), V4Precision.of("bfloat16"))


@pytest.mark.parametrize(("dp", "tp"), [(4, 1), (2, 2)], ids=["dp4", "dp2xtp2"])
def test_plan_counts_what_an_ep_rank_builds(dp, tp):
    """Under EP (over dp x tp = 4 ranks) the plan's weights equal an EP rank's model
    (engine/v4/expert_parallel.py: 2 of the tiny model's 8 routed experts per layer, whole;
    at tp 2 the rest split as engine/v4/tp.py says, the shared expert included)."""
    from engine.parallel import EPGroup, TPGroup  # noqa: PLC0415

    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(TINY, TPGroup(rank=1, size=tp) if tp > 1 else None,
                                      EPGroup(rank=3, size=4))
    bias = sum(b.numel() for n, b in model.named_buffers()
               if n.endswith("e_score_correction_bias"))
    rows = _rows(plan_role_v4(TINY, _layout(dp=dp, tp=tp, ep=True), V4Precision.of("bfloat16")))
    weights = sum(n for k, n in rows.items() if not k.startswith(("KV", "workspace"))
                  and k != "hash router tid2eid")
    assert weights == sum(p.numel() for p in model.parameters()) + bias
    assert rows["routed experts"] == TINY.num_hidden_layers * 2 * 3 * TINY.hidden_size * \
        TINY.moe_intermediate_size
    assert rows["shared expert"] == TINY.num_hidden_layers * 3 * TINY.hidden_size * \
        TINY.moe_intermediate_size // tp


def test_release_precision():
    """Kept (engine/v4/stored.py): FP8 linears 1 byte + float32 block scales (128 x 128), FP4
    experts packed (no FP8 expert scales); dequantized: everything at dtype."""
    raw = json.loads(FLASH.read_text())
    kept = V4Precision.for_checkpoint(raw, "bfloat16", "fp8")
    assert (kept.expert, kept.linear, kept.weight) == (FP4_BYTES, 1.0, 2)
    assert kept.fp8_block == (128, 128) and not kept.expert_scales
    fp8_experts = V4Precision.for_checkpoint(raw | {"expert_dtype": "fp8"}, "bfloat16", "fp8")
    assert fp8_experts.expert == 1.0 and fp8_experts.expert_scales
    plain = V4Precision.for_checkpoint(raw, "bfloat16", "dequantize")
    assert (plain.expert, plain.linear, plain.fp8_block) == (2, 2, None)


def _weights_gb(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"weights \(sum\)\s+([\d.]+)", out)]


def test_a3_v4_dry_runs_with_the_release_storage_kept(capsys):
    """The shipped A3 V4 layout keeps the release's storage (``model.fp8_storage: fp8``):
    tp 16 and tp 4 parts are whole 128 x 128 blocks, so it dry-runs clean; its plan (equal
    to the loaded engine's bytes: tests/engine/test_v4_fp8_storage.py) holds 6.41 / 7.73 GB
    of weights per prefill / decode rank: linears 1 byte + float32 block scales, the
    compressors at bf16, routed experts packed FP4."""
    assert main(["up", "--dry-run", str(A3_V4)]) == 0
    out, err = capsys.readouterr()
    assert out.count("memory plan per rank") == 1 and "not memory-planned" not in out
    assert "KV: CSA entries 1/4" in out and "planner on a3" in out
    assert out.index("decode: dp 8 x tp 4, ep on (EP 32)") < out.index("planner on a3")
    assert "memory plan: fits" in out and "not supported yet" not in err
    assert "linears 1 B/el, routed experts 0.5312 B/el" in out
    assert out.count("FP8 block scales") == 2
    assert _weights_gb(out) == [6.41, 7.73]


def test_a3_v4_dequantized_dry_runs_with_bf16_experts(tmp_path, capsys):
    """With ``model.fp8_storage: dequantize`` (engine/v4 dequantizes FP8 linears and FP4
    experts at load) the A3 V4 layout dry-runs clean, its plan counting the routed experts
    at bf16, as loaded (20.00 / 22.24 GB of weights per prefill / decode rank)."""
    text = A3_V4.read_text().replace("fp8_storage: fp8 ", "fp8_storage: dequantize ")
    text = text.replace("config_json: models/", f"config_json: {REPO}/configs/models/")
    assert "fp8_storage: dequantize" in text
    (tmp_path / "a3.yaml").write_text(text)
    assert main(["up", "--dry-run", str(tmp_path / "a3.yaml")]) == 0
    out = capsys.readouterr().out
    assert "linears 2 B/el, routed experts 2 B/el" in out and "memory plan: fits" in out
    assert _weights_gb(out) == [20.00, 22.24] and "FP8 block scales" not in out


def test_a3_v4_too_many_blocks_suggests_how_many_fit():
    """The most blocks and the most sequences that fit (the group pools hold min(max_num_seqs,
    what num_kv_blocks' budget holds) 68K requests: at 4608 blocks 109; found on the plan)."""
    def load(blocks: int, seqs: int = 256):
        return load_config(A3_V4, {"decode.max_num_seqs": seqs, "decode.num_kv_blocks": blocks},
                           planning=True)

    with pytest.raises(MemoryPlanError) as err:
        check_memory(load(4608))
    most = int(re.search(r"lower decode.num_kv_blocks from 4608 to <= (\d+)",
                         str(err.value)).group(1))
    assert check_memory(load(most)).startswith("memory plan: fits")
    with pytest.raises(MemoryPlanError):
        check_memory(load(most + 1))
    seqs = int(re.search(r"lower decode.max_num_seqs from 256 to <= (\d+)",
                         str(err.value)).group(1))
    assert check_memory(load(4608, seqs)).startswith("memory plan: fits")
    with pytest.raises(MemoryPlanError):
        check_memory(load(4608, seqs + 1))


def test_a_pd_role_plans_its_staging_cache_and_a_colocated_one_none(tmp_path):
    from engine.v4.staging import staging_bytes

    prec = V4Precision.of("bfloat16")
    colocated = _rows(plan_role_v4(TINY, _layout(role="colocated"), prec))
    assert "KV: PD staging rows" not in colocated
    pd = plan_role_v4(TINY, _layout(staging_blocks=5), prec)
    row = next(r for r in pd.rows if r.kind == "KV: PD staging rows")
    assert row.bytes == staging_bytes(TINY, 5, 16, 2)  # what the runner allocates
    cfg = load_config(REPO / "configs" / "v4_1p1d.yaml", {"decode.v4_staging_blocks": 7})
    from orchestrator.config.memory_check import role_layouts

    got = {lay.role: lay.staging_blocks for lay in role_layouts(cfg)}
    assert got == {"prefill": cfg.prefill.num_kv_blocks, "decode": 7}


def test_a_layout_the_plan_cannot_split_names_the_key_to_change():
    """EP over dp 3 x tp 1 (8 experts) and tp 3 (4 heads): the error names the role's keys,
    not a ``tp`` the user never set."""
    with pytest.raises(ValueError, match=r"^decode\.ep: the expert-parallel size decode\.dp x "
                                         r"decode\.tp = 3 x 1 = 3 does not divide DeepSeek-V4's "
                                         r"n_routed_experts \(8\)"):
        plan_role_v4(TINY, _layout(dp=3, ep=True), V4Precision.of("bfloat16"))
    with pytest.raises(ValueError, match=r"^decode\.tp=3: .*num_attention_heads \(4\)"):
        plan_role_v4(TINY, _layout(role="colocated", tp=3), V4Precision.of("bfloat16"))
    with pytest.raises(ValueError, match=r"^prefill\.tp=3: "):
        plan_role_v4(TINY, _layout(role="prefill", tp=3), V4Precision.of("bfloat16"))


def test_dry_run_of_an_ep_size_that_does_not_divide_the_experts_names_dp(tmp_path, capsys):
    text = (REPO / "configs" / "v4_ep_colocated.yaml").read_text()
    cfg = tmp_path / "v4_ep3.yaml"
    cfg.write_text(text.replace("  dp: 2\n", "  dp: 3\n", 1))
    assert main(["up", "--dry-run", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "decode.ep" in err and "decode.dp x decode.tp = 3 x 1" in err, err
    assert "tp 3" not in err, err


@pytest.mark.parametrize(("role", "dp", "tp"), [("prefill", 2, 16), ("decode", 8, 4)])
def test_a3_kept_plan_counts_the_engines_kept_modules(role, dp, tp):
    """Flash at the A3 layout's shapes (EP 32 rank 0): the kept-storage plan's weight bytes
    equal the state-dict bytes of engine/v4's model built on meta with the release's FP8 set
    swapped for Fp8BlockLinear and the experts for packed MXFP4 (engine/v4/stored.py;
    tests/engine/test_v4_fp8_storage.py checks the same on loaded tiny checkpoints, where the
    checkpoint's scales pick the set): 6.41 / 7.73 GB."""
    from engine.parallel import EPGroup, TPGroup  # noqa: PLC0415
    from engine.quant.formats import v4_quant_scheme  # noqa: PLC0415
    from engine.v4.stored import FP4, RELEASE_FP8, keep_quantized  # noqa: PLC0415

    raw = json.loads(FLASH.read_text())
    cfg = V4Config.from_dict(raw)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, TPGroup(rank=0, size=tp),
                                      EPGroup(rank=0, size=dp * tp)).to(torch.bfloat16)
    keep_quantized(model, v4_quant_scheme(raw), lambda n: bool(RELEASE_FP8.fullmatch(n)), FP4)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    plan = plan_role_v4(cfg, _layout(role=role, dp=dp, tp=tp, ep=True, block_size=128),
                        V4Precision.for_checkpoint(raw, "bfloat16", "fp8"))
    assert plan.bytes_of("weights") == held
    assert round(held / 1e9, 2) == {"prefill": 6.41, "decode": 7.73}[role]

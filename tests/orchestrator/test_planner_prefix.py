"""The planner's prefix-cache hit rate on small hand-computed cases: the cached tokens a hit
rate leaves (whole blocks, the last token computed), a trace's hit rate (unbounded and LRU),
prefill over a cached prefix, transfer bytes of the uncached tokens only, ``--explain``,
``orch plan --trace`` and the memory plan's prefix-cache line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from orchestrator.config.load import load_config
from orchestrator.config.memory_check import describe_memory
from orchestrator.planner.comm_terms import kv_transfer_cost
from orchestrator.planner.cost import forward_cost, prefill_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.terms import Work
from orchestrator.planner.counts import attention_flops, kv_bytes_per_token
from orchestrator.planner.load import WorkloadSpec, parse_workload
from orchestrator.planner.prefix_hits import cached_tokens, trace_hit_rate
from orchestrator.planner.report import format_plan, plan_config
from orchestrator.planner.specs import named_device
from tests.e2e.harness import REPO

SEED = REPO / "configs" / "a3_v32_p2x16_d8x4.yaml"  # block 128, chunk 8192, P cp 16


def test_cached_tokens_are_whole_blocks_and_never_the_last_prompt_token():
    assert cached_tokens(1000, 0.5, 128) == 384      # 500 tokens -> 3 whole blocks
    assert cached_tokens(1024, 1.0, 128) == 896      # 8 blocks, the 8th holds the last token
    assert cached_tokens(1025, 1.0, 128) == 1024
    assert cached_tokens(100, 0.9, 128) == 0         # no whole block
    assert cached_tokens(65536, 0.5, 128) == 32768
    assert cached_tokens(64, 0.0, 16) == 0
    with pytest.raises(ValueError):
        cached_tokens(64, 1.5, 16)


def test_trace_hit_rate_counts_the_leading_run_of_blocks_seen_before():
    # hits 0 + 2 ([0, 1]) + 1 ([0]) + 0 of 3 + 3 + 2 + 1 blocks
    assert trace_hit_rate([[0, 1, 2], [0, 1, 3], [0, 4], [5]]) == pytest.approx(3 / 9)
    assert trace_hit_rate([[0, 1], [9, 1]]) == 0.0  # block 1 after another head: no prefix
    with pytest.raises(ValueError, match="hash_ids"):
        trace_hit_rate([[], []])


def test_a_bounded_cache_evicts_the_least_recently_used_tail_first():
    reqs = [[0, 1, 2], [3, 4], [0, 1, 2]]
    assert trace_hit_rate(reqs) == pytest.approx(3 / 8)
    # capacity 3: after [3, 4] the cache holds 0, 4, 3 (tails 2 then 1 left first)
    assert trace_hit_rate(reqs, capacity=3) == pytest.approx(1 / 8)
    assert trace_hit_rate(reqs, capacity=5) == pytest.approx(3 / 8)


def test_parse_workload_takes_a_hit_rate_in_0_1():
    assert parse_workload("in=64,out=8,hit=0.25").hit == 0.25
    assert parse_workload("in=64,out=8").hit == 0.0
    for bad in ("hit=1.5", "hit=-0.1", "hit=nan"):
        with pytest.raises(ValueError, match="hit="):
            parse_workload(f"in=64,out=8,{bad}")


def _seed_plan(hit: float):
    return plan_config(load_config(SEED), WorkloadSpec(65536, 3072, concurrency=29, hit=hit),
                       named_device("a3"))


def test_prefill_over_a_cached_prefix_computes_the_rest_attending_over_all():
    plan = _seed_plan(0.0)
    m, prec, hw = plan.memory.model, plan.memory.precision, Hardware(plan.device)
    pre = replace(plan.prefill, layout=replace(plan.prefill.layout, cp=1))
    # 16384 tokens, 8192 cached: one chunk of 8192 after 8192 past
    one = prefill_cost(m, pre, prec, hw, 16384, 8192, cached=8192)
    attn = attention_flops(m, 8192, 8192, absorbed=False)
    by_hand = forward_cost(m, pre, prec, hw, plan.workload.options,
                           Work(8192, attn, 0.0, 0.0, False))
    assert one.total_s == pytest.approx(by_hand.total_s)
    alone = prefill_cost(m, pre, prec, hw, 8192, 8192)  # the same tokens, no prefix
    assert one.total_s > alone.total_s
    assert prefill_cost(m, pre, prec, hw, 16384, 8192).total_s > one.total_s
    with pytest.raises(ValueError, match="cached"):
        prefill_cost(m, pre, prec, hw, 128, 128, cached=128)


def test_a_hit_rate_cuts_prefill_and_ships_only_the_uncached_kv():
    off, on = _seed_plan(0.0), _seed_plan(0.5)
    assert (on.cached, on.shipped) == (32768, 32768)
    assert (off.cached, off.shipped) == (0, 65536)
    m, prec, hw = on.memory.model, on.memory.precision, Hardware(on.device)
    group = on.prefill.layout.ranks + on.decode.layout.ranks
    assert on.transfer.total_s == pytest.approx(
        kv_transfer_cost(m, prec, hw, 32768, group).total_s)
    layers_latency = m.num_hidden_layers * hw.latency_s
    assert on.transfer.total_s - layers_latency == pytest.approx(
        (off.transfer.total_s - layers_latency) / 2)
    # attention over the cached prefix: more than half of the whole prompt's prefill
    assert off.prefill_cost.total_s / 2 < on.prefill_cost.total_s < off.prefill_cost.total_s
    assert on.point.ttft_s < off.point.ttft_s
    lines = format_plan(on, explain=True)
    assert "prefix-cache hit 0.5" in lines[0]
    assert any("prefix cache: hit 0.5 of 65536 prompt tokens -> 32768 cached" in line
               and "ships 32768" in line for line in lines)
    gb = 32768 * kv_bytes_per_token(m, prec) / 1e9
    assert any(line.startswith("kv transfer per request") and f"({gb:.2f} GB)" in line
               for line in lines)
    assert not any("prefix cache" in line for line in format_plan(off, explain=True))


def test_orch_plan_trace_takes_the_hit_rate_of_its_hash_ids(tmp_path, capsys):
    from orchestrator.cli import main

    rows = [(0, 1024, 8, [0, 1]), (1000, 1536, 8, [0, 1, 2]), (2000, 1024, 8, [0, 3]),
            (3000, 512, 8, [4])]
    trace = tmp_path / "mini.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": t, "input_length": i,
                                         "output_length": o, "hash_ids": h}) + "\n"
                             for t, i, o, h in rows))
    assert main(["plan", str(SEED), "--trace", str(trace), "--explain"]) == 0
    out = capsys.readouterr().out
    # hits 0 + 2 + 1 + 0 of 2 + 3 + 2 + 1 blocks = 0.375; the pools hold far more
    assert "mean in=1024 out=8, prefix-cache hit 0.375" in out
    assert "blocks of 512 tokens: the prefill KV pools (ideal, unbounded: 0.375)" in out
    # 1024 x 0.375 = 384 tokens = 3 blocks of 128
    assert "prefix cache: hit 0.375 of 1024 prompt tokens -> 384 cached" in out


def test_the_memory_plan_says_the_kv_pool_is_the_prefix_cache(tmp_path):
    cfg = load_config(SEED)
    lines = describe_memory(cfg)
    assert sum("prefix cache: in the KV pool (no extra memory)" in line for line in lines) == 2
    assert any("up to 2688 blocks (344,064 tokens) per DP rank" in line for line in lines)
    off = cfg.model_copy(update={"decode": cfg.decode.model_copy(
        update={"prefix_cache": False})})
    assert any("prefix cache: off (decode.prefix_cache: false)" in line
               for line in describe_memory(off))

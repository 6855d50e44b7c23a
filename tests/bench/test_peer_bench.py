"""benchmarks/peer_bench.py: with ``--orch-graph`` both orch configs it writes load with
decode graph mode on, every bucket up to max_num_seqs captured at start-up, and prefill graph
mode on where prefill steps run; each instance's load time is read from the ``orch up`` log."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import peer_bench
from orchestrator.config.load import load_config


@pytest.mark.parametrize("seqs, want", [(1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]),
                                        (12, [1, 2, 4, 8, 12])])
def test_graph_buckets_cover_every_batch_up_to_max_num_seqs(seqs, want):
    assert peer_bench.graph_buckets(seqs) == want


@pytest.mark.parametrize("base, role", [("colocated.yaml", "colocated"), ("1p1d.yaml", "decode")])
@pytest.mark.parametrize("graph", [False, True])
def test_orch_configs_run_graph_modes_only_when_asked(tmp_path, base, role, graph):
    args = argparse.Namespace(levels=[1, 8], input_len=256, output_len=64, out=tmp_path,
                              orch_graph=graph)
    path, _ = peer_bench.orch_config(base, args, tmp_path / "ckpt", "side")
    cfg = load_config(path)
    by_role = {inst.role: inst.graph for inst in cfg.instances()}
    assert by_role[role].enabled is graph
    if graph:
        assert by_role[role].batch_sizes == (1, 2, 4, 8)
        assert by_role[role].warmup and by_role[role].required
    if role == "decode":
        assert not by_role["prefill"].enabled  # NOTE: no decode step runs on prefill
    prefill = {inst.role: inst.prefill_graph for inst in cfg.instances()}
    prefill_role = "colocated" if role == "colocated" else "prefill"
    assert prefill[prefill_role].enabled is graph
    assert prefill[prefill_role].required is graph
    if role == "decode":
        assert not prefill["decode"].enabled  # NOTE: decode instances run no prefill step


def test_instance_load_times_come_from_the_orch_up_log(tmp_path):
    log = tmp_path / "side.up.log"
    log.write_text("orch up: prefill-0: 1 rank process up on node 192.0.2.2 (11bebd) in 3.5 s\n"
                   "orch up: prefill-0: 1 rank on node 192.0.2.2 (11bebd) ready in 5.1 s\n"
                   "orch up: decode-0: 2 ranks on node 192.0.2.2 (11bebd) ready in 15.7 s\n"
                   "orch up: 2 instances ready in 15.7 s\n")
    assert peer_bench.instance_ready_seconds(log) == {"prefill-0": 5.1, "decode-0": 15.7}
    assert peer_bench.instance_ready_seconds(tmp_path / "missing.log") == {}


def _rounds(*ttfts):
    return [{"ttft_p50_ms": t, "tpot_ms": 5.0, "output_tok_s": 100.0 / t, "failed": 0,
             "errors": {}} for t in ttfts]


def test_orch_pd_is_compared_with_vllm_and_with_vllms_pd():
    runs = {"orch-colocated-graph": _rounds(20, 30), "orch-pd-graph": _rounds(30, 40),
            "vllm": _rounds(10, 30), "vllm-pd": _rounds(60, 100)}
    sides = peer_bench.summarize_level(8, runs)["sides"]
    pd = sides["orch-pd-graph"]["ttft_p50_ms"]
    assert pd["ratio"] == pytest.approx(35 / 20)
    assert pd["round_ratios"] == pytest.approx((40 / 30, 30 / 10))
    assert pd["pd_ratio"] == pytest.approx(35 / 80)
    assert pd["pd_round_ratios"] == pytest.approx((0.4, 0.5))
    assert "pd_ratio" not in sides["orch-colocated-graph"]["ttft_p50_ms"]
    for peer in ("vllm", "vllm-pd"):  # NOTE: vLLM's rows carry no ratios
        assert set(sides[peer]["tpot_ms"]) == {"median", "range"}


def test_without_vllms_pd_there_is_no_pd_ratio():
    sides = peer_bench.summarize_level(1, {"orch-pd": _rounds(30), "vllm": _rounds(10)})["sides"]
    assert sides["orch-pd"]["output_tok_s"]["ratio"] == pytest.approx(1 / 3)
    assert "pd_ratio" not in sides["orch-pd"]["output_tok_s"]


def test_a_sides_failed_requests_are_counted_not_fatal(capsys):
    """A peer that fails a request (vLLM's PD answered one 502 at c = 8) stays in the run:
    its rounds' failures are summed on its row and the table names them."""
    runs = {"orch-pd": _rounds(30, 40), "vllm-pd": _rounds(60, 100)}
    runs["vllm-pd"][0].update(failed=1, errors={"HTTP_502": 1})
    row = peer_bench.summarize_level(8, runs)
    assert row["sides"]["vllm-pd"]["failed"] == 1 and row["sides"]["orch-pd"]["failed"] == 0
    peer_bench.print_table([row], argparse.Namespace(input_len=256, output_len=64, rounds=2))
    table = capsys.readouterr().out
    assert "| 8 | vllm-pd (1 failed) |" in table and "| 8 | orch-pd |" in table


def test_a_round_whose_requests_all_failed_is_left_out_of_medians_and_ratios(capsys):
    """Run 12: orch colocated's c = 8 round 2 failed all 16 requests (its rank missed health
    pings beside vLLM's PD): no figure (None) for that round, the others still count."""
    runs = {"orch-colocated": _rounds(20, 30, 40), "vllm": _rounds(10, 10, 20)}
    runs["orch-colocated"][2].update(ttft_p50_ms=None, tpot_ms=None, output_tok_s=0.0,
                                     failed=16, errors={"UNAVAILABLE": 16})
    row = peer_bench.summarize_level(8, runs)
    ttft = row["sides"]["orch-colocated"]["ttft_p50_ms"]
    assert ttft["median"] == pytest.approx(25) and ttft["range"] == (20, 30)
    assert ttft["ratio"] == pytest.approx(25 / 10) and ttft["round_ratios"] == (2.0, 3.0)
    failed = [{"ttft_p50_ms": None, "tpot_ms": None, "output_tok_s": 0.0, "failed": 16,
               "errors": {}}]
    gone = peer_bench.summarize_level(8, {"a": failed, "vllm": _rounds(10)})["sides"]
    assert gone["a"]["tpot_ms"] == {"median": None, "range": None}
    peer_bench.print_table([row], argparse.Namespace(input_len=256, output_len=64, rounds=3))
    assert "| 8 | orch-colocated (16 failed) | 25.0 [20.0-30.0] (**2.50**)" in capsys.readouterr().out

"""benchmarks/ttft_bench.py: a side names its config, its overrides and the checkout whose
code runs it (a change A/B-measured against its base in one session); the breakdown rows
come from each request's own phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import ttft_bench

REPO = Path(__file__).resolve().parents[2]


def test_a_side_runs_this_checkout_unless_another_is_named(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "1p1d.yaml").write_text("mode: disaggregated\n")
    assert ttft_bench.parse_side("eager=1p1d:router.eager_prefill=true,prefill.tp=2") == (
        "eager", "1p1d", {"router.eager_prefill": True, "prefill.tp": 2}, REPO)
    assert ttft_bench.parse_side(f"before=1p1d@{tmp_path}:router.eager_prefill=false") == (
        "before", "1p1d", {"router.eager_prefill": False}, tmp_path.resolve())
    assert ttft_bench.parse_side("sock=1p1d:router.leader_calls=socket,prefill.tp=-1") == (
        "sock", "1p1d", {"router.leader_calls": "socket", "prefill.tp": -1}, REPO)
    with pytest.raises(ValueError, match="colocated.yaml does not exist"):
        ttft_bench.parse_side(f"x=colocated@{tmp_path}")
    with pytest.raises(ValueError, match="expected NAME=CONFIG"):
        ttft_bench.parse_side("=1p1d")


def test_phase_rows_are_per_request_with_what_the_server_did_not_see(tmp_path):
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"requests": [
        {"ttft_ms": 30.0, "ttft_phases_ms": {"transport": 5.0, "forward": 20.0}},
        {"ttft_ms": None, "ttft_phases_ms": {}},  # failed
        {"ttft_ms": 12.0, "ttft_phases_ms": {}}]}))  # a server that sent no breakdown
    assert ttft_bench.phase_rows(report) == [
        {"transport": 5.0, "forward": 20.0, "unseen": pytest.approx(5.0)}]


def test_ratios_are_round_by_round(capsys):
    runs = {(1, "a"): [(2.0, 4.0, 6.0), (3.0, 4.0, 5.0)], (1, "b"): [(1.0, 2.0, 3.0),
                                                                   (3.0, 8.0, 1.0)]}
    ttft_bench.print_ratios(runs, ["a/b"])
    assert capsys.readouterr().out == ("a/b c=1 per round: TTFT p50 2.00 1.00 | "
                                       "TPOT p50 2.00 0.50 | tok/s 2.00 5.00\n")


def test_cpu_seconds_grow_with_this_process_s_work():
    import os
    import time

    before, start = ttft_bench.cpu_s(os.getpid()), time.thread_time()
    while time.thread_time() - start < 0.1:
        pass
    assert ttft_bench.cpu_s(os.getpid()) - before >= 0.05

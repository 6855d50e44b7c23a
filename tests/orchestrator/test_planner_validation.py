"""The planner's terms as printed: `orch plan --explain`, the validation page in
docs/planner.md (its tables and summary are what the code computes) and
`python -m orchestrator.planner.validation --row`."""

from __future__ import annotations

import math

from tests.e2e.harness import REPO


def test_explain_prints_every_term_and_what_bounds_the_step(capsys):
    from orchestrator.cli import main

    assert main(["plan", str(REPO / "configs" / "a3_v32_p2x16_d8x4.yaml"), "--workload",
                 "in=65536,out=3072,concurrency=29,mtp=1,accept=0.7", "--explain"]) == 0
    out = capsys.readouterr().out
    for word in ("linears [attention", "attention [attention", "routed experts [moe",
                 "all-to-all dispatch [dispatch", "all-to-all combine [combine",
                 "TP collectives [serial", "MTP drafts", "MTP: 1.7 tokens per step",
                 "expert-load imbalance", "overlap (two micro-batches, prefill schedule",
                 "elementwise (attention) [attention-0, memory]", "elementwise (MoE) [moe",
                 "output linears [attention", "shared experts [shared"):
        assert word in out, word


def test_validation_page_shows_the_tables_figures():
    from orchestrator.planner.validation import summary, table

    rows = table()
    text = (REPO / "docs" / "planner.md").read_text()
    assert summary(rows) in text
    for r in rows:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
        assert f"| {r['key']} |" in text
    from orchestrator.planner.validation import CHECKS, markdown

    assert markdown(rows) in text  # the tables as `--markdown` prints them
    assert all(f"| {c.key} |" in text for c in CHECKS)
    devices = {r["device"] for r in rows if r["role"] != "seed"}
    assert {"h800", "h100", "a3"} <= devices  # NVIDIA and Huawei chips
    # the goal set is the capacity rows; the fleet averages are shown as the utilization
    # they imply (published / predicted), not counted in the error
    capacity = [r for r in rows if r["role"] != "seed" and not r["fleet"]]
    assert f"over {len(capacity)} capacity throughputs" in summary(rows)
    for r in rows:
        if r["fleet"]:
            assert f"{r['key']} {1 / r['ratio']:.2f}" in summary(rows)


def test_validation_row_command_prints_the_rows_terms(capsys):
    from orchestrator.planner.validation import ROWS, main, row_cost

    assert main(["--row", "cm384-decode"]) == 0
    out = capsys.readouterr().out
    row = next(r for r in ROWS if r.key == "cm384-decode")
    assert f"ratio {row_cost(row)[1] / row.figure:.2f}" in out
    assert "MTP: 1.7 tokens per step" in out and "all-to-all combine" in out

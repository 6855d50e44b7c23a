"""`python -m orchestrator.bench` end to end against the fake server: JSON, plots, compare."""

from __future__ import annotations

import json

from bench_fake_orch import FakeOrch, FakeServer
from orchestrator.bench.cli import main
from orchestrator.bench.workloads import DEFAULT_TRACES


def test_cli_run_writes_report_plots_and_compares(tmp_path, capsys, shared_data):
    trace = shared_data(DEFAULT_TRACES["mooncake"])  # the CLI's default for --workload mooncake
    fake = FakeOrch(ttft_s=0.05, itl_s=0.005, fail_every=5)
    with FakeServer(fake) as server:
        common = ["--address", server.address, "--workload", "mooncake", "--num-requests", "10",
                  "--warmup", "1", "--scale-lengths", "0.01", "--max-output-len", "4",
                  "--time-scale", "0.01", "--max-concurrency", "4", "--no-progress",
                  "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000"]
        rc_a = main(common + ["--label", "a", "--output", str(tmp_path / "a.json"),
                              "--plot", str(tmp_path / "plots")])
        rc_b = main(common + ["--label", "b", "--output", str(tmp_path / "b.json")])
    assert rc_a == 0 and rc_b == 0
    rep = json.loads((tmp_path / "a.json").read_text())
    # warm-up index 0; timed 1..10; index 5 and 10 fail
    assert rep["counts"]["requested"] == 10 and rep["counts"]["failed"] == 2
    assert rep["counts"]["warmup"] == 1 and rep["errors"] == {"RESOURCE_EXHAUSTED": 2}
    raw = [json.loads(line) for line in trace.read_text().splitlines()[:11]]
    outs = [max(1, round(x["output_length"] * 0.01)) for x in raw]
    assert rep["counts"]["capped"] == sum(o > 4 for o in outs) > 0
    got = {r["index"]: r["output_tokens"] for r in rep["requests"] if r["error_code"] is None}
    assert got == {i: min(outs[i], 4) for i in range(1, 11) if i % 5}
    assert 1 <= fake.max_in_flight <= 4
    assert (tmp_path / "plots" / "a_ttft_cdf.png").stat().st_size > 0
    capsys.readouterr()
    assert main(["--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "B/A" in out and "request_throughput" in out


def test_cli_bad_input_exit_codes(tmp_path, capsys):
    assert main(["--workload", "azure", "--trace", str(tmp_path / "none.csv")]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["--address", "127.0.0.1:1", "--connect-timeout", "0.3", "--num-requests", "1",
                 "--no-progress"]) == 1
    assert "orch up" in capsys.readouterr().err

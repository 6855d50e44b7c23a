"""`orch bench --up A B`: every config is served and replayed in turn, then A is compared with
each later config; a config that cannot be read is exit 2 (bring-up itself: tests/e2e)."""

from __future__ import annotations

from pathlib import Path


from orchestrator.bench import serve
from orchestrator.bench.cli import main
from orchestrator.bench.report import summarize
from orchestrator.bench.records import RunResult


def _report(path: Path, label: str) -> Path:
    report = summarize(RunResult(records=(), duration_s=1.0, started_at=0.0), label=label, workload="w",
                       num_capped=0, num_skipped=0)
    report.to_json(path)
    return path


def test_up_replays_each_config_in_order_then_compares(tmp_path, monkeypatch, capsys):
    served = []

    def fake_serve(config, args, out):
        served.append((config.name, args.workload, out))
        return serve.ServedConfig(config, _report(out / f"{config.stem}.json", config.stem), 0)

    monkeypatch.setattr(serve, "serve_and_replay", fake_serve)
    code = main(["--up", "a.yaml", "b.yaml", "c.yaml", "--up-out", str(tmp_path),
                 "--workload", "synthetic", "--no-progress"])
    assert code == 0
    assert [s[0] for s in served] == ["a.yaml", "b.yaml", "c.yaml"]
    assert all(s[1] == "synthetic" and s[2] == tmp_path for s in served)
    assert capsys.readouterr().out.count("B/A") == 2  # a vs b, a vs c


def test_up_fails_when_a_replay_completes_nothing(tmp_path, monkeypatch):
    def fake_serve(config, args, out):
        return serve.ServedConfig(config, _report(out / f"{config.stem}.json", "x"), 1)

    monkeypatch.setattr(serve, "serve_and_replay", fake_serve)
    assert main(["--up", "a.yaml", "--up-out", str(tmp_path), "--no-progress"]) == 1


def test_up_with_a_missing_config_is_a_usage_error(tmp_path, capsys):
    assert main(["--up", str(tmp_path / "nope.yaml"), "--up-out", str(tmp_path)]) == 2
    assert "nope.yaml" in capsys.readouterr().err

"""`orch up --dry-run`: every shipped config validates and dry-runs creating nothing, and the
report says the placement, resources, layers and the KV transfer plan."""

from __future__ import annotations

import json

import pytest

from orchestrator.cli import main
from orchestrator.config.load import load_config
from tests.orchestrator.test_config import CONFIGS


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

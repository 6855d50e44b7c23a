"""`orch up --dry-run CONFIG` (a subprocess, as a user runs it) prints the real KV transfer
plan: every (prefill rank, decode rank) pair and its layers equal
``kv_transfer.build_transfer_plan`` for the config's tp sizes and layer count, and the plan is
said to apply to every (prefill instance, decode instance) pair."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kv_transfer import build_transfer_plan
from orchestrator.checkpoint import DEEPSEEK_V3_LAYERS
from orchestrator.config import load_config
from orchestrator.tiny_model import tiny_config_dict
from tests.e2e.harness import REPO

PAIR = re.compile(r"^  prefill rank (\d+) -> decode rank (\d+): (\d+) layer\(s\) (\S+)$")
USED_BY = re.compile(r"^transfer plan P(\d+) -> D(\d+) \(MLA\), used by (\d+) instance "
                     r"pair\(s\): (.*)$")


def expand(ranges: str) -> tuple[int, ...]:
    """"0-2,5" -> (0, 1, 2, 5); "-" -> ()."""
    if ranges == "-":
        return ()
    out: list[int] = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return tuple(out)


def dry_run(config: str, tmp_path) -> list[str]:
    """Lines printed by `orch up --dry-run configs/CONFIG` (fresh cache: no checkpoint)."""
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "up", "--dry-run",
         str(REPO / "configs" / config)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env=dict(os.environ, ORCH_CACHE_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("config, num_layers", [
    ("a3_p2x16_d8x4.yaml", DEEPSEEK_V3_LAYERS),  # /models/DeepSeek-V3 absent: V3's 61 layers
    ("1p1d.yaml", int(tiny_config_dict()["num_hidden_layers"])),
])
def test_dry_run_prints_the_real_transfer_plan(config, num_layers, tmp_path):
    cfg = load_config(REPO / "configs" / config)
    lines = dry_run(config, tmp_path)
    assert any(line.startswith(f"layers: {num_layers} (") for line in lines), lines

    (used_by,) = [m for m in map(USED_BY.match, lines) if m]
    assert (int(used_by[1]), int(used_by[2])) == (cfg.prefill.tp, cfg.decode.tp)
    names = [i.name for i in cfg.instances()]
    expected_pairs = [f"{p}->{d}" for p in names if p.startswith("prefill")
                      for d in names if d.startswith("decode")]
    assert int(used_by[3]) == len(expected_pairs) == cfg.prefill.dp * cfg.decode.dp
    assert used_by[4].split(", ") == expected_pairs

    printed = [(int(m[1]), int(m[2]), int(m[3]), expand(m[4]))
               for m in map(PAIR.match, lines) if m]
    plan = build_transfer_plan(cfg.prefill.tp, cfg.decode.tp, num_layers, kind="mla")
    assert printed == [(p.prefill_rank, p.decode_rank, len(p.layers), tuple(p.layers))
                       for p in plan.pairs]


def test_dry_run_refuses_a_tp_that_does_not_divide_the_heads(tmp_path):
    import yaml

    data = yaml.safe_load((REPO / "configs" / "1p1d.yaml").read_text())
    data["prefill"]["tp"] = 3  # the tiny model has 4 heads
    config = tmp_path / "tp3.yaml"
    config.write_text(yaml.safe_dump(data))
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "up", "--dry-run", str(config)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env=dict(os.environ, ORCH_CACHE_DIR=str(tmp_path)))
    assert done.returncode == 2, done.stdout
    assert "- prefill.tp: tp=3 does not divide num_attention_heads=4" in done.stderr
    assert "tp sizes that divide every split size: [1, 2, 4]" in done.stderr
    assert done.stdout == ""

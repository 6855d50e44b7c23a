"""`orch up --dry-run CONFIG` (a subprocess, as a user runs it) prints the real KV transfer
plan: every (prefill rank, decode rank) pair and its layers equal
``kv_transfer.build_transfer_plan`` for the config's tp sizes and layer count, and the plan is
said to apply to every (prefill instance, decode instance) pair. It prints the memory plan of
one rank per role (rows equal ``orchestrator.config.memory_check.build_memory_plan``) and exits 2,
saying by how much, when a layout does not fit the device. For an accelerator layout it ends
with the planner's predicted TTFT / TPOT / tokens/s (``orchestrator.planner``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from kv_transfer import build_transfer_plan
from orchestrator.config.checkpoint import DEEPSEEK_V3_LAYERS
from orchestrator.config.load import load_config
from orchestrator.config.devices import GB
from orchestrator.config.memory_check import build_memory_plan
from orchestrator.planner.load import WorkloadSpec
from orchestrator.planner.report import plan_config, predicted_line
from orchestrator.planner.specs import default_device
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


ROW = re.compile(r"^  (\S.*?) +([\d,]+) +([\d.]+) +([\d.]+)  (.*)$")


def run_dry_run(config_path, tmp_path) -> subprocess.CompletedProcess:
    """`orch up --dry-run CONFIG_PATH` (fresh cache: no checkpoint)."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "up", "--dry-run", str(config_path)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env=dict(os.environ, ORCH_CACHE_DIR=str(tmp_path)))


def dry_run(config: str, tmp_path) -> list[str]:
    """Lines printed by `orch up --dry-run configs/CONFIG` (fresh cache: no checkpoint)."""
    done = run_dry_run(REPO / "configs" / config, tmp_path)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.fixture(scope="module")
def printed(tmp_path_factory):
    """configs/ name -> its dry-run lines, each config run once per module (a few s each)."""
    cache: dict[str, list[str]] = {}

    def lines(config: str) -> list[str]:
        if config not in cache:
            cache[config] = dry_run(config, tmp_path_factory.mktemp("cache"))
        return cache[config]

    return lines


@pytest.mark.parametrize("config, num_layers", [
    ("a3_p2x16_d8x4.yaml", DEEPSEEK_V3_LAYERS),  # /models/DeepSeek-V3 absent: V3's 61 layers
    ("1p1d.yaml", int(tiny_config_dict()["num_hidden_layers"])),
])
def test_dry_run_prints_the_real_transfer_plan(config, num_layers, printed):
    cfg = load_config(REPO / "configs" / config)
    lines = printed(config)
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


def test_dry_run_prints_the_memory_plan(printed):
    cfg = load_config(REPO / "configs" / "a3_p2x16_d8x4.yaml")
    lines = printed("a3_p2x16_d8x4.yaml")
    plan, _ = build_memory_plan(cfg)
    printed = [(m[1], int(m[2].replace(",", "")), float(m[4]), m[5])
               for m in map(ROW.match, lines) if m]
    expected = [(row.kind, row.elements, round(row.bytes / GB, 2), row.split)
                for role in plan.roles for row in role.rows]
    assert printed == expected
    totals = [line for line in lines if line.lstrip().startswith("total ")]
    assert totals == [f"  {'total':<48}{role.total_bytes / GB:>10.2f}  of 64.00 GB: headroom "
                      f"{(64 * GB - role.total_bytes) / GB:.2f} GB "
                      f"({100 * (64 * GB - role.total_bytes) / (64 * GB):.1f} %)"
                      for role in plan.roles]
    assert "memory plan: fits npu default: Atlas A3 die (64.00 GB)" in lines


def test_dry_run_prints_the_planner_figures_for_an_a3_layout(printed):
    cfg = load_config(REPO / "configs" / "a3_p2x16_d8x4.yaml")
    point = plan_config(cfg, WorkloadSpec(65536, 3072), default_device("npu")).point
    lines = printed("a3_p2x16_d8x4.yaml")
    assert lines[-2].startswith("planner on a3, in=65536 out=3072"), lines[-2:]
    assert lines[-1] == "  " + predicted_line(point)


def test_dry_run_refuses_a_layout_that_does_not_fit(tmp_path):
    import yaml

    data = yaml.safe_load((REPO / "configs" / "a3_p2x16_d8x4.yaml").read_text())
    data["model"]["config_json"] = str(REPO / "configs" / "models" / "deepseek-v3" /
                                       "config.json")
    data["decode"]["ep"] = False  # the replica-only layout: all 256 experts on every DP rank
    config = tmp_path / "a3_no_ep.yaml"
    config.write_text(yaml.safe_dump(data))
    done = run_dry_run(config, tmp_path)
    assert done.returncode == 2, done.stdout
    assert "  total                                               347.56  of 64.00 GB: " \
        "EXCEEDS by 283.56 GB" in done.stdout.splitlines()
    assert done.stderr.startswith("orch up: the layout does not fit the device memory:\n"
                                  "- decode: one rank needs 347.56 GB (weights 337.06, KV 9.79, "
                                  "workspace 0.03, communicators 0.69) but the device has "
                                  "64.00 GB (npu default: Atlas A3 die): exceeds it by 283.56 "
                                  "GB (5.43x). To fit: set decode.ep: true (61.90 GB per rank, "
                                  "8 experts each)"), \
        done.stderr

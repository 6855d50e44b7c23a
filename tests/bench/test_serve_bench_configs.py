"""benchmarks/serve_bench.py builds valid configs whose two sides differ only in the PD
layout: same scheduler sizes, enough KV blocks for the largest level, colocated dp 2 for the
loaded levels (no `orch up` here)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

from orchestrator.config.load import load_config

REPO = Path(__file__).resolve().parents[2]


def _serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench",
                                                  REPO / "benchmarks" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module  # NOTE: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_deployment_loads_with_the_same_scheduler_sizes(tmp_path):
    sb = _serve_bench()
    args = argparse.Namespace(levels=[1, 8, 32], tp=2, input_len=256, output_len=64,
                              pd_prefill_chunk=None)
    cfgs = {name: load_config(sb.write_config(dep, tmp_path))
            for name, dep in sb.deployments(args).items()}
    pd, dp1, dp2 = cfgs["pd"], cfgs["colocated-dp1"], cfgs["colocated-dp2"]
    assert (pd.mode, dp1.mode, dp2.mode) == ("disaggregated", "colocated", "colocated")
    assert (pd.prefill.tp, pd.decode.tp, dp1.decode.tp, dp2.decode.tp) == (1, 2, 2, 2)
    assert (pd.decode.dp, dp1.decode.dp, dp2.decode.dp) == (1, 1, 2)
    per_request = math.ceil((256 + 64) / pd.kv_transfer.block_size)
    for cfg in cfgs.values():
        assert cfg.decode.max_num_seqs >= 32
        assert cfg.decode.num_kv_blocks >= 32 * per_request
        assert cfg.decode.num_kv_blocks == pd.decode.num_kv_blocks
        # NOTE: PD's default chunking (1p1d.yaml's, 256) is colocated.yaml's
        assert (cfg.prefill.chunk_size, cfg.prefill.max_num_batched_tokens) == (
            pd.prefill.chunk_size, pd.prefill.max_num_batched_tokens)
        assert cfg.model.max_model_len >= 256 + 64
        assert cfg.router.max_pending >= 32 and cfg.router.metrics_port is None


def test_pd_prefill_chunk_changes_only_the_prefill_instance(tmp_path):
    sb = _serve_bench()
    args = argparse.Namespace(levels=[1, 8], tp=1, input_len=256, output_len=64,
                              pd_prefill_chunk=128)
    deps = sb.deployments(args)
    pd = load_config(sb.write_config(deps["pd"], tmp_path))
    colocated = load_config(sb.write_config(deps["colocated-dp2"], tmp_path))
    assert pd.prefill.chunk_size == 128
    assert colocated.prefill.chunk_size == 256  # configs/colocated.yaml's

"""KV bytes per request, DeepSeek-V4-Flash vs DeepSeek-V3.2, from the configs and specs alone
(no model, no device): what a decode instance holds for one request and what PD ships for it.

V4: :func:`orchestrator.config.memory_plan_v4.kv_elements_per_request` (engine/v4/kv_spec.py's
rows at ``n`` tokens: window, compressed entries with CSA's index keys, compressor state);
V3.2: :func:`orchestrator.planner.counts.kv_bytes_per_request` (the layer specs' latent + k_pe
+ index_k in every layer, :func:`engine.kv_layer_spec.held_bytes`). Both at 2 bytes per element
(bf16 KV). Configs: configs/models/deepseek-v4 and configs/models/deepseek-v32. Run:
``PYTHONPATH=. python benchmarks/v4_kv_memory.py`` (``--lengths 65536,131072``); it prints a
markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.model_config import ModelConfig
from engine.v4.config import V4Config
from orchestrator.config.memory_plan import Precision
from orchestrator.config.memory_plan_v4 import kv_elements_per_request
from orchestrator.planner.counts import kv_bytes_per_request

MODELS = Path(__file__).resolve().parents[1] / "configs" / "models"


def rows(lengths: list[int]) -> list[str]:
    """Markdown table rows: per length, V4's bytes by kind, V3.2's, and the ratio."""
    v4 = V4Config.from_dict(json.loads((MODELS / "deepseek-v4" / "config.json").read_text()))
    v32 = ModelConfig.from_dict(json.loads((MODELS / "deepseek-v32" / "config.json").read_text()))
    bf16 = Precision.of("bfloat16")
    out = ["| tokens | V4 window MB | V4 entries MB | V4 state MB | V4 total MB | V3.2 MB "
           "| V4 / V3.2 |", "|---|---|---|---|---|---|---|"]
    for n in lengths:
        parts = {k: v * bf16.kv / 1e6 for k, v in kv_elements_per_request(v4, n).items()}
        mine, theirs = sum(parts.values()), kv_bytes_per_request(v32, bf16, n) / 1e6
        out.append(f"| {n:,} | {parts['window']:.2f} | {parts['entries']:.1f} | "
                   f"{parts['state']:.3f} | {mine:.1f} | {theirs:,.0f} | {mine / theirs:.3f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,65536,131072,1048576",
                   help="comma-separated request lengths, tokens")
    ns = p.parse_args()
    print("\n".join(rows([int(x) for x in ns.lengths.split(",")])))


if __name__ == "__main__":
    main()

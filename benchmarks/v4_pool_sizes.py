"""DeepSeek-V4 KV pools of one rank per role, before (every group ``num_kv_blocks`` blocks) and
after (engine/pool_plan.py: the budget split by what ``max_num_seqs`` requests of
``max_model_len`` hold per group), from a config's memory plan alone (no model, no device).

Per role: the pools' bytes (window + entries tensors, plus the compressor state of the
requests they hold: before ``max_num_seqs`` of it, as the plan counted), how many requests of
``max_model_len`` the pools admit at once (the fewest over the groups of ``blocks //
blocks per request``; the scheduler runs at most ``max_num_seqs``), and the rank's total from
the memory plan. Run: ``PYTHONPATH=. python benchmarks/v4_pool_sizes.py configs/v4_1p1d.yaml
configs/a3_v4_p2x16_d8x4.yaml``; it prints a markdown table.
"""

from __future__ import annotations

import argparse

from engine.pool_plan import PoolPlan, plan_pools
from engine.v4.kv_spec import layer_specs
from orchestrator.config.load import load_config
from orchestrator.config.memory_check import build_memory_plan
from orchestrator.config.memory_plan_v4 import pool_plan

GB = 1e9
SHORT = {"window": "window", "entries/compressed_sparse_attention": "CSA",
         "entries/heavily_compressed_attention": "HCA"}


def admitted(pools: PoolPlan, per_request: dict[str, int]) -> int:
    """Requests holding ``per_request`` blocks each that every group's pool admits at once."""
    return min(pools.blocks[g] // n for g, n in per_request.items())


def rows(path: str) -> list[str]:
    """One markdown row per role of the config at ``path``."""
    cfg = load_config(path, planning=True)
    plan, source = build_memory_plan(cfg)
    if plan is None:
        raise SystemExit(f"{path}: no memory plan ({source})")
    out, kv = [], plan.precision.kv
    for role in plan.roles:
        lay, after = role.layout, pool_plan(plan.model, role.layout)
        before = plan_pools(layer_specs(plan.model), lay.num_kv_blocks, lay.block_size, None)
        state = sum(after.row_elements[g] for g in after.blocks if g.startswith("state/"))
        before_bytes = (before.stored_elements() + lay.max_num_seqs * state) * kv
        after_bytes = sum(after.elements(g) for g in after.blocks) * kv
        old = role.total_bytes - after_bytes + before_bytes
        blocks = ", ".join(f"{SHORT[g]} {n}" for g, n in after.blocks.items() if g in SHORT)
        out.append(f"| {path.split('/')[-1]} {lay.role} | {lay.num_kv_blocks} x "
                   f"{lay.block_size}, {lay.max_num_seqs} seqs x {lay.max_model_len:,} | "
                   f"{before_bytes / GB:.4g} GB, {admitted(before, after.per_request)} | "
                   f"{blocks}: {after_bytes / GB:.4g} GB, "
                   f"{admitted(after, after.per_request)} | {old / GB:.4g} -> "
                   f"{role.total_bytes / GB:.4g} GB |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+")
    args = ap.parse_args()
    print("| config, role | num_kv_blocks x block, request shape | before: KV pools, requests "
          "admitted | after: blocks per group, KV pools, requests admitted | rank total |")
    print("|---|---|---|---|---|")
    for path in args.configs:
        print("\n".join(rows(path)))


if __name__ == "__main__":
    main()

"""What a DeepSeek-V4 decode request reserves per KV group (engine/v4/admission.py) against the
per-token reservation it made before (docs/engine.md "Admission by what a request will hold").

Per prompt length (+ ``--output`` tokens, a token a step, blocks of ``--block-size``): the
blocks it commits per group (``kv_groups.reservation``) and their bytes (``group_bytes``
per block), against the context's blocks in every group (what admission by prompt +
max_tokens scheduler blocks assumed: a request could hold that many in each group), and how
many such requests pools of ``--blocks`` blocks each admit either way. Also the staging rows'
bytes a PD request holds until decode rebuilt its cache (``staging_blocks_for`` x
``staging_bytes_per_slot``). Shapes: transformers' default ``DeepseekV4Config`` (43 layers)
unless ``--config`` names a config.json; bf16.

    PYTHONPATH=$PWD python benchmarks/v4_reservation.py --tokens 4096 32768 131072 1048576
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from v4_kv_bytes import v4_config  # noqa: E402

from engine.kv_groups import kv_groups, reservation  # noqa: E402
from engine.v4.block_table import group_bytes  # noqa: E402
from engine.v4.kv_spec import PER_REQUEST, layer_specs  # noqa: E402
from engine.v4.staging import staging_blocks_for, staging_bytes_per_slot  # noqa: E402

MIB, ELEM = 2 ** 20, 2  # bf16


def row(config, prompt: int, output: int, block_size: int, blocks: int) -> dict:
    """One prompt length's figures (bytes, block counts, requests admitted)."""
    groups = kv_groups(layer_specs(config))
    per_block = {k: v // blocks for k, v in group_bytes(config, blocks, block_size,
                                                          ELEM).items()}
    sizes = {g.name: 1 if g.per == PER_REQUEST else block_size for g in groups}
    need = reservation(groups, sizes, prompt + output, 1)
    context = -(-(prompt + output) // block_size)
    before = {g.name: 1 if g.per == PER_REQUEST else context for g in groups}
    return {"need": need,
            "bytes": sum(need[k] * per_block[k] for k in need),
            "before": sum(before[k] * per_block[k] for k in need),
            "admitted": min(blocks // n for n in need.values()),
            "admitted_before": blocks // context,
            "staging": staging_blocks_for(config, prompt, block_size) * block_size
            * staging_bytes_per_slot(config, ELEM)}


def _short(group: str) -> str:
    """``entries/compressed_sparse_attention`` -> ``CSA entries``."""
    kinds = {"compressed_sparse_attention": "CSA", "heavily_compressed_attention": "HCA"}
    what, _, kind = group.partition("/")
    return f"{kinds.get(kind, kind)} {what}" if kind else what


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072, 1048576])
    ap.add_argument("--output", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=65536, help="blocks of every group's pool")
    ap.add_argument("--config", help="a V4 config.json (default: transformers' default)")
    args = ap.parse_args()
    config = v4_config(args.config)
    print(f"| prompt | reserved per group (blocks of {args.block_size}) | reserved | before "
          f"| ratio | admitted by {args.blocks}-block pools (before) | staging until rebuilt |")
    print("|---|---|---|---|---|---|---|")
    for prompt in args.tokens:
        r = row(config, prompt, args.output, args.block_size, args.blocks)
        groups = ", ".join(f"{_short(k)} {n}" for k, n in r["need"].items())
        print(f"| {prompt:,} | {groups} | {r['bytes'] / MIB:,.1f} MiB | "
              f"{r['before'] / MIB:,.1f} MiB | {r['bytes'] / r['before']:.3f} | "
              f"{r['admitted']} ({r['admitted_before']}) | {r['staging'] / MIB:,.1f} MiB |")


if __name__ == "__main__":
    main()

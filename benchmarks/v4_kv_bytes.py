"""KV bytes a DeepSeek-V4 request ships through PD against what DeepSeek-V3.2 ships for the same
prompt length (docs/kv_transfer.md "DeepSeek-V4: staged per-layer state").

V4: per layer its kind's own rows (``layer_rows(n)``) of its kind's width (engine/v4/staging.py;
tests/workers/test_v4_pd.py checks both connectors move exactly this many bytes). Padded: what
every layer shipped before it shipped only its own rows, ``staged_rows(n)`` (the widest kind's
count) rows of every layer. V4 state: the sum over layers of the specs' ``elements(n)`` (what
decode needs; the rows pad each region to whole rows). V3.2:
K, V and index_k of every token of every layer (61 x (512 + 64 + 128) elements per token:
:func:`engine.kv_layer_spec.held_elements` of configs/models/deepseek-v32's layer specs). V4
shapes: transformers' default ``DeepseekV4Config``
(43 layers) unless ``--config`` names a config.json.

    PYTHONPATH=$PWD python benchmarks/v4_kv_bytes.py --tokens 1024 4096 32768 131072
"""

from __future__ import annotations

import argparse
import json

from pathlib import Path

from engine.kv_layer_spec import held_elements, mla_layer_specs
from engine.model_config import ModelConfig
from engine.v4.config import V4Config
from engine.v4.kv_spec import layer_specs
from engine.v4.staging import kind_widths, layer_rows, staged_rows

MIB = 2 ** 20
V32_JSON = Path(__file__).resolve().parents[1] / "configs" / "models" / "deepseek-v32" \
    / "config.json"


def v4_config(path: str | None) -> V4Config:
    """The V4 config of ``path`` (a config.json), else transformers' default one."""
    if path:
        with open(path) as f:
            return V4Config.from_dict(json.load(f))
    from transformers import DeepseekV4Config  # noqa: PLC0415 (default shapes only)

    return V4Config.from_dict(DeepseekV4Config().to_dict())


def rows_for(config: V4Config, tokens: list[int], elem: int) -> list[tuple[int, ...]]:
    """Per prompt length: (tokens, V4 shipped B, V4 padded B, V4 state B, V3.2 shipped B)."""
    # NOTE: StagingSpec.bytes_per_token_of, for ``elem``-byte elements
    widths = [kind_widths(config)[kind] * elem for kind in config.layer_types]
    specs = layer_specs(config)
    v32 = mla_layer_specs(ModelConfig.from_dict(json.loads(V32_JSON.read_text())))
    return [(n, sum(r * w for r, w in zip(layer_rows(config, n), widths, strict=True)),
             staged_rows(config, n) * sum(widths), held_elements(specs, n) * elem,
             held_elements(v32, n) * elem) for n in tokens]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 32768, 131072])
    ap.add_argument("--config", help="a DeepSeek-V4 config.json (default: transformers')")
    ap.add_argument("--bytes-per-element", type=int, default=2, help="2: bf16")
    args = ap.parse_args()
    config = v4_config(args.config)
    print(f"V4: {config.num_hidden_layers} layers, kind widths {kind_widths(config)}, "
          f"window {config.sliding_window}; {args.bytes_per_element} B per element")
    print("| prompt tokens | V4 shipped | V4 padded (before) | shipped / padded | V4 state | "
          "V3.2 shipped | shipped / V3.2 | state / V3.2 |\n|---|---|---|---|---|---|---|---|")
    for n, v4, padded, state, v32 in rows_for(config, args.tokens, args.bytes_per_element):
        print(f"| {n:,} | {v4 / MIB:,.1f} MiB | {padded / MIB:,.1f} MiB | {v4 / padded:.2f} | "
              f"{state / MIB:,.1f} MiB | {v32 / MIB:,.1f} MiB | {v4 / v32:.3f} | "
              f"{state / v32:.3f} |")


if __name__ == "__main__":
    main()

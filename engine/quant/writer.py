"""Write a quantized checkpoint from a float one (``orch model quantize SRC DST --scheme``).

``fp8-block``: DeepSeek's FP8 format; ``w8a8``: compressed-tensors int8 W8A8 as llm-compressor's
``W8A8`` scheme writes it, ``ignore: [lm_head]`` (:mod:`engine.quant.formats`). Only decoder
linear weights (``model.layers.*.*_proj.weight``, experts included) are quantized; the output
is HF-sharded (``shard_bytes``, ``model.safetensors.index.json``), other files copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.quant.formats import QUANTIZED_WEIGHT
from engine.quant.fp8_block import quantize_block
from engine.quant.load import CheckpointTensors
from engine.quant.w8a8 import quantize_per_channel

SCHEMES = ("fp8-block", "w8a8")
FP8_BLOCK_SIZE = (128, 128)
_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
         "block_structure": None, "actorder": None, "observer_kwargs": {}, "scale_dtype": None,
         "zp_dtype": None}


def quantization_config(scheme: str) -> dict:
    """The ``quantization_config`` written into config.json for ``scheme`` (W8A8: the layout
    llm-compressor 0.14 / compressed-tensors 0.19 write for its ``W8A8`` preset)."""
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(FP8_BLOCK_SIZE)}
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
            "config_groups": {"group_0": {
                "targets": ["Linear"], "format": "int-quantized", "output_activations": None,
                "weights": {**_INT8, "strategy": "channel", "dynamic": False,
                            "observer": "minmax"},
                "input_activations": {**_INT8, "strategy": "token", "dynamic": True,
                                      "observer": None}}}}


def quantize_tensor(name: str, t: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """``{name: t}`` or, for a decoder-layer linear weight, the weight and its scale."""
    if not QUANTIZED_WEIGHT.fullmatch(name):
        return {name: t}
    if t.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; only [out, in] linear weights "
                         "quantize (fused expert tensors: write per-expert names first)")
    if scheme == "fp8-block":
        q, scale_inv = quantize_block(t, FP8_BLOCK_SIZE)
        return {name: q, f"{name}_scale_inv": scale_inv}
    q, scale = quantize_per_channel(t)
    return {name: q, f"{name}_scale": scale}


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str,
                        shard_bytes: int = 5 * 2**30) -> Path:
    """Write ``src`` quantized with ``scheme`` to ``dst`` (created); returns ``dst``.

    Raises:
        ValueError: unknown scheme, ``shard_bytes`` < 1, a source that is quantized already,
            or fused experts.
        FileNotFoundError: ``src`` has no config.json.
        FileExistsError: ``dst`` is a file or a folder that is not empty (its old shards
            would be read together with the new ones).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"--scheme {scheme!r}: use one of {list(SCHEMES)}")
    if shard_bytes < 1:
        raise ValueError(f"shard size {shard_bytes} bytes: use --shard-mb 1 or more")
    src, dst = Path(src), Path(dst)
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst} exists and is not an empty folder: write to a new or "
                              "empty folder (old shards there would load with the new ones)")
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method")
        raise ValueError(f"{src} is quantized already ({method}): quantize from a float "
                         "(bf16/fp32) checkpoint")
    dst.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    with CheckpointTensors(src) as tensors:
        for name in sorted(tensors.names()):
            full = tensors.read(name, [(0, n) for n in tensors.shape(name)])
            for out_name, t in quantize_tensor(name, full, scheme).items():
                if shards[-1] and _nbytes(shards[-1]) + _nbytes({0: t}) > shard_bytes:
                    shards.append({})
                shards[-1][out_name] = t.contiguous()
    _write_shards(dst, shards)
    config["quantization_config"] = quantization_config(scheme)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copyfile(path, dst / path.name)
    return dst


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _write_shards(dst: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    """``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``."""
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(dst / file), metadata={"format": "pt"})
        (dst / file).chmod(0o644)  # NOTE: safetensors writes a private (0600) temp file
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": sum(_nbytes(s) for s in shards)},
             "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def quantize_main(src: str, dst: str, scheme: str, shard_mb: int) -> Path:
    """CLI body of ``orch model quantize``: write, then say what was written."""
    out = quantize_checkpoint(src, dst, scheme, shard_bytes=shard_mb * 2**20)
    files = sorted(out.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in files) / 2**20
    print(f"wrote {scheme} checkpoint ({len(files)} shards, {size:.1f} MiB) to {out}")
    return out

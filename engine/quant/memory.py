"""Bytes a rank stores for its weights under a quantized checkpoint (for the memory plan).

Follows :mod:`engine.quant.linear`: decoder linears stay quantized (``kv_b_proj`` excepted),
everything else is in the compute dtype, as is everything under FP8 ``fp8_storage:
dequantize``. Sum :func:`stored_weight_bytes` over ``(name, local shape)`` rows, or multiply a
parameter count by :func:`bytes_per_param` (exact up to the scales).
"""

from __future__ import annotations

from engine.quant.formats import FP8_BLOCK, QUANTIZED_WEIGHT, QuantScheme
from engine.quant.fp8_block import block_grid
from engine.quant.linear import NEVER_QUANTIZED

SCALE_BYTES = 4  # float32 scales


def is_stored_quantized(name: str, scheme: QuantScheme | None, fp8_storage: str) -> bool:
    """True when this runtime keeps checkpoint weight ``name`` quantized in memory."""
    if scheme is None or (scheme.method == FP8_BLOCK and fp8_storage == "dequantize"):
        return False
    module = name.removesuffix(".weight").rpartition(".")[2]
    return bool(QUANTIZED_WEIGHT.fullmatch(name)) and module not in NEVER_QUANTIZED


def stored_weight_bytes(name: str, shape: tuple[int, ...], scheme: QuantScheme | None,
                        dtype_bytes: int, fp8_storage: str = "dequantize") -> int:
    """Bytes of weight ``name`` with local ``shape`` (``[out, in]`` for linears), scales
    included: FP8 ``out*in + 4*ceil(out/128)*ceil(in/128)``, W8A8 ``out*in + 4*out``, else
    ``numel * dtype_bytes``."""
    numel = 1
    for n in shape:
        numel *= n
    if not is_stored_quantized(name, scheme, fp8_storage):
        return numel * dtype_bytes
    out, inp = shape
    if scheme.method == FP8_BLOCK:
        rows, cols = block_grid(out, inp, scheme.block_size)
        return numel + SCALE_BYTES * rows * cols
    return numel + SCALE_BYTES * out


def bytes_per_param(scheme: QuantScheme | None, dtype_bytes: int,
                    fp8_storage: str = "dequantize") -> float:
    """Bytes per parameter of a quantized decoder linear, scales of a 7168 x 2048 weight
    (DeepSeek-V3's expert ``down_proj``) spread in: FP8 ~1.0002, W8A8 ~1.0006; the
    compute dtype's size when not stored quantized."""
    name = "model.layers.0.mlp.down_proj.weight"
    return stored_weight_bytes(name, (7168, 2048), scheme, dtype_bytes, fp8_storage) \
        / (7168 * 2048)

"""Quantized checkpoint formats: ``quantization_config`` of config.json -> :class:`QuantScheme`.

- DeepSeek FP8 (``quant_method: fp8``, V3/R1): a linear weight ``W [out, in]`` is
  float8_e4m3fn with float32 ``weight_scale_inv [ceil(out/128), ceil(in/128)]``; the weight is
  ``W * scale_inv`` of its 128 x 128 block (last block may be partial); activations float.
- compressed-tensors int8 W8A8 (``format: int-quantized``, as llm-compressor writes it):
  ``weight`` int8 ``[out, in]``, ``weight_scale [out, 1]`` (symmetric per channel);
  activations quantized per token at run time (scale = max|x| / 127).

NOTE: a weight is quantized when its scale tensor exists in the checkpoint
(:func:`engine.quant.load.quant_plan`), not per config lists. Anything else raises
:class:`UnsupportedQuantizationError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

FP8_BLOCK = "fp8_block"
W8A8_INT8 = "w8a8_int8"
SUPPORTED_METHODS = ("fp8 (DeepSeek e4m3, weight_block_size [128, 128])",
                     "compressed-tensors (int8 W8A8: channel weights, dynamic token activations)")
SCALE_SUFFIX = {FP8_BLOCK: "weight_scale_inv", W8A8_INT8: "weight_scale"}
QUANTIZED_WEIGHT = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight")
"""Weights a quantized DeepSeek checkpoint stores quantized (DeepSeek's FP8 release and
``orch model quantize`` alike): every linear of the decoder layers, experts included; the
embedding, norms, router gate and lm_head stay float."""


class UnsupportedQuantizationError(ValueError):
    """config.json's ``quantization_config`` names a method or variant orch cannot run."""


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint's linear weights are quantized.

    Attributes:
        method: :data:`FP8_BLOCK` or :data:`W8A8_INT8`.
        block_size: (rows, cols) of one FP8 scale block; None for W8A8 (per channel).
        expert_fp4: DeepSeek-V4's routed experts are MXFP4 (``expert_dtype: fp4``,
            :mod:`engine.quant.mxfp4`); the other linears are ``method``.
    """

    method: str
    block_size: tuple[int, int] | None = None
    expert_fp4: bool = False

    @property
    def scale_suffix(self) -> str:
        """The scale of weight ``x.weight`` is ``x.`` + this (``weight_scale_inv`` or
        ``weight_scale``)."""
        return SCALE_SUFFIX[self.method]


def parse_quantization_config(raw: dict[str, Any] | None) -> QuantScheme | None:
    """The :class:`QuantScheme` of a ``quantization_config`` dict (None: not quantized).

    Raises:
        UnsupportedQuantizationError: a method, number format, block size or strategy other
            than the two supported formats; the message names the field and what is supported.
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _unsupported("", raw, " (an object is expected)")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_deepseek_fp8(raw)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    raise _unsupported("quant_method", method)


def _unsupported(field: str, value: Any, detail: str = "") -> UnsupportedQuantizationError:
    path = f"quantization_config.{field}" if field else "quantization_config"
    return UnsupportedQuantizationError(
        f"config.json {path} is {value!r}{detail}; orch runs "
        f"{' or '.join(SUPPORTED_METHODS)}: convert the checkpoint to one of these (e.g. "
        "`orch model quantize SRC DST --scheme fp8-block|w8a8` from a bf16 checkpoint)")


def _parse_deepseek_fp8(raw: dict[str, Any]) -> QuantScheme:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported("fmt", fmt)
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported("activation_scheme", raw.get("activation_scheme"))
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(type(b) is int and b > 0 for b in block)):
        raise _unsupported("weight_block_size", block, " (two positive integers expected; "
                                                         "per-tensor FP8 is not supported)")
    return QuantScheme(FP8_BLOCK, block_size=(int(block[0]), int(block[1])))


_W8A8_WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
_W8A8_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                "dynamic": True}


def _parse_compressed_tensors(raw: dict[str, Any]) -> QuantScheme:
    fmt = raw.get("format")
    if fmt not in ("int-quantized", "naive-quantized"):
        raise _unsupported("format", fmt, " (int8 W8A8 is written as 'int-quantized')")
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _unsupported("config_groups", groups, " (exactly one group expected)")
    name, group = next(iter(groups.items()))
    if not isinstance(group, dict):
        raise _unsupported(f"config_groups.{name}", group, " (an object is expected)")
    targets = group.get("targets")
    if not isinstance(targets, list) or "Linear" not in targets:
        raise _unsupported(f"config_groups.{name}.targets", targets)
    for part, want in (("weights", _W8A8_WEIGHTS), ("input_activations", _W8A8_INPUTS)):
        got = group.get(part) or {}
        if not isinstance(got, dict):
            raise _unsupported(f"config_groups.{name}.{part}", got, " (an object is expected)")
        for key, value in want.items():
            if got.get(key) != value:
                raise _unsupported(f"config_groups.{name}.{part}.{key}", got.get(key),
                                   f" (int8 W8A8 needs {value!r})")
    return QuantScheme(W8A8_INT8)


def v4_quant_scheme(raw: dict[str, Any]) -> QuantScheme | None:
    """The :class:`QuantScheme` of a DeepSeek-V4 config.json ``raw`` that :mod:`engine.v4`
    can load (None: unquantized), after refusing what it cannot.

    DeepSeek-V4-Flash's release (configs/models/deepseek-v4/config.json, transformers 5.23's
    ``deepseek_v4`` + FP8 quantizer) stores the attention, output, indexer ``q_b`` and
    shared-expert linears FP8 e4m3 with one scale per 128 x 128 block (``scale_fmt: ue8m0``:
    power-of-two scales, stored ``float8_e8m0fnu`` as ``<module>.scale`` or float32 as
    ``<module>.weight_scale_inv``), the compressors' ``kv_proj`` / ``gate_proj`` and the
    indexer's ``weights_proj`` bf16, and the routed experts FP4 (``expert_dtype: fp4``,
    top-level or inside ``quantization_config``: MXFP4, :mod:`engine.quant.mxfp4`).
    engine/v4 dequantizes both at load (``fp8_storage: dequantize``, V3's default) or keeps
    them as stored (``fp8``, :mod:`engine.v4.stored`).

    Raises:
        UnsupportedQuantizationError: an ``expert_dtype`` other than fp4 / fp8 / bf16, or fp4
            without an FP8 ``quantization_config`` (the release has both); a method other
            than DeepSeek FP8 (W8A8 int8 is V3-only); a malformed FP8 config
            (:func:`parse_quantization_config`).
    """
    qc = raw.get("quantization_config")
    expert = raw.get("expert_dtype") or (qc.get("expert_dtype") if isinstance(qc, dict) else None)
    if expert not in (None, "fp4", "fp8", "bf16", "bfloat16"):
        raise UnsupportedQuantizationError(
            f"config.json expert_dtype is {expert!r}: engine/v4 reads DeepSeek-V4's routed "
            "experts FP4 (MXFP4, e2m1 + an e8m0 scale per 32 weights), FP8 block or bf16 "
            "(docs/quantization.md \"DeepSeek-V4\")")
    scheme = parse_quantization_config(qc or None)
    if scheme is not None and scheme.method != FP8_BLOCK:
        raise UnsupportedQuantizationError(
            f"config.json quantization_config is {scheme.method}: engine/v4 loads DeepSeek "
            "FP8 block checkpoints (quant_method fp8, e4m3, 128 x 128 scales) and float ones; "
            "int8 W8A8 runs on DeepSeek-V3 only")
    if expert == "fp4":
        if scheme is None:
            raise UnsupportedQuantizationError(
                "config.json expert_dtype is 'fp4' without a quantization_config: give it "
                "the release's (quant_method fp8, fmt e4m3, weight_block_size [128, 128]) "
                "with the FP4 experts (docs/quantization.md \"DeepSeek-V4\")")
        scheme = QuantScheme(scheme.method, scheme.block_size, expert_fp4=True)
    return scheme

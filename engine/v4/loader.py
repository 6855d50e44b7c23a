"""Load a DeepSeek-V4 checkpoint directory into :class:`engine.v4.model.DeepseekV4ForCausalLM`.

Two namings are read (per tensor, whichever the files hold, :mod:`engine.v4.checkpoint`):
transformers' (the model's own parameter names, experts fused ``gate_up_proj`` /
``down_proj``) and DeepSeek's released one (``layers.{i}.attn.wq_a.weight``,
``layers.{i}.ffn.experts.{j}.w1.weight``, ``hc_head_fn``, ...). ``mtp.*`` (the MTP layer) is
never read. An FP8 block checkpoint (DeepSeek-V4-Flash's linears:
:func:`engine.quant.formats.v4_quant_scheme`) is dequantized to float at load: a weight with a
scale tensor (``<name>_scale_inv``, or DeepSeek's ``<module>.scale``) is
``e4m3 x scale`` of its 128 x 128 block (:func:`engine.quant.fp8_block.dequantize_block`);
the release's routed experts (``expert_dtype: fp4``) are MXFP4, packed e2m1 pairs with a
``<module>.scale`` e8m0 per 32 inputs, dequantized at load too
(:func:`engine.quant.mxfp4.dequantize_mxfp4`).
With ``fp8_storage="fp8"`` both stay as stored instead (:mod:`engine.v4.stored`: FP8 linears
V3's way, FP4 experts packed). Under TP each rank reads the whole tensor and keeps its part
(:meth:`engine.v4.tp.V4Shards.local_part`; the split table is :mod:`engine.v4.tp`'s). Under EP
(:mod:`engine.v4.expert_parallel`) a rank reads only its own routed experts, whole (not
TP-split): the per-expert tensors of its ids, or its rows of a fused tensor (a safetensors
slice).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import CheckpointError
from engine.parallel import EPGroup, TPGroup
from engine.quant.formats import QuantScheme, UnsupportedQuantizationError, v4_quant_scheme
from engine.quant.fp8_block import block_grid, dequantize_block
from engine.quant.linear import FP8_STORAGE
from engine.quant.mxfp4 import MXFP4_BLOCK, PACKED_DTYPES, dequantize_mxfp4
from engine.v4.checkpoint import (check_expert_count, count_experts, deepseek_name,
                                  expert_prefix, get_tensor, index_tensors, scale_of)
from engine.v4.config import V4Config
from engine.v4.expert_parallel import EPExperts
from engine.v4.model import DeepseekV4ForCausalLM, v4_rotaries
from engine.v4.stored import expert_storage, keep_quantized, load_stored, stored_scale
from engine.v4.tp import V4Shards, check_tp

def load_v4(checkpoint_dir: str | Path, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu", tp: TPGroup | None = None,
            ep: EPGroup | None = None, fp8_storage: str = "dequantize") -> DeepseekV4ForCausalLM:
    """Build the model of ``checkpoint_dir/config.json`` (this rank's part under ``tp``;
    ``ep``: only EP rank ``ep.rank``'s routed experts) and load its weights; a quantized
    checkpoint's weights dequantized to ``dtype`` (``fp8_storage="dequantize"``) or kept as
    stored (``"fp8"``, :mod:`engine.v4.stored`). The model is built on the meta device and
    allocated once, in its final form.

    Raises:
        CheckpointError: see :meth:`V4Config.from_dict` and :func:`load_v4_weights`; a
            quantization engine/v4 cannot run (W8A8, an unknown ``expert_dtype``:
            :func:`engine.quant.formats.v4_quant_scheme`; the message says what to do).
        ValueError: the TP size does not divide a size the split keeps whole
            (:func:`engine.v4.tp.check_tp`); ``ep.size`` does not divide
            ``n_routed_experts``; ``fp8_storage`` not in
            :data:`engine.quant.linear.FP8_STORAGE`.
    """
    if fp8_storage not in FP8_STORAGE:
        raise ValueError(f"fp8_storage {fp8_storage!r}: use one of {list(FP8_STORAGE)}")
    raw = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    try:
        scheme = v4_quant_scheme(raw)
    except UnsupportedQuantizationError as e:
        raise CheckpointError(f"{checkpoint_dir}: {e}") from e
    config, tp = V4Config.from_dict(raw), tp or TPGroup()
    check_tp(config, tp.size)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, tp, ep).to(dtype)
    if scheme is not None and fp8_storage == "fp8":
        where = index_tensors(checkpoint_dir)
        keep_quantized(model, scheme, lambda name: stored_scale(name, where) is not None,
                       expert_storage(model, where, scheme))
    model.to_empty(device=device)
    with torch.device(device):
        model.rotary = v4_rotaries(config).to(dtype)
    load_v4_weights(model, checkpoint_dir, scheme)
    return model.eval()


def load_v4_weights(model: DeepseekV4ForCausalLM, checkpoint_dir: str | Path,
                    scheme: QuantScheme | None = None) -> None:
    """Copy every model tensor from the checkpoint (either naming, see module doc); under
    ``model.tp`` only this rank's part of each split one; EP experts (:class:`EPExperts`)
    only their ``expert_ids``, whole. ``scheme``: the checkpoint's FP8 block format, MXFP4
    routed experts where ``scheme.expert_fp4`` (None: float); weights with a scale tensor are
    dequantized (float32, then the model's dtype), except into the modules
    :func:`engine.v4.stored.keep_quantized` swapped in, which get them as stored
    (:func:`engine.v4.stored.fill_linear`, :func:`engine.v4.stored.fill_experts`).

    Raises:
        CheckpointError: no ``*.safetensors``; a tensor missing under both names (message
            names both); a (whole) shape other than the config's; a checkpoint whose expert
            count is not the config's (under EP); a scale tensor without ``scheme``, or one
            whose grid is not the weight's ``weight_block_size`` grid; a quantized weight
            (FP8 / int / FP4-packed) without a scale; with one, a routed expert not packed
            MXFP4 (with a ``[out, in / 32]`` scale) under ``expert_dtype: fp4``, any other
            weight not e4m3; a fused expert tensor with a scale.
    """
    where = index_tensors(checkpoint_dir)
    shards = V4Shards(model.config.o_groups, model.tp.size, model.tp.rank)
    done = load_stored(model, where, shards)
    held = {f"{prefix}.{p}": m for prefix, m in model.named_modules()
            if isinstance(m, EPExperts) for p in ("gate_up_proj", "down_proj")}
    for name, target in model.state_dict().items():
        if name in done:
            continue
        value = _read(name, where, held.get(name), scheme)
        # NOTE: EP experts are whole on their rank: no TP part to take
        whole = tuple(target.shape) if name in held else \
            shards.full_shape(name, tuple(target.shape))
        if tuple(value.shape) != whole:
            raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(value.shape)}; "
                                  f"the config implies {whole}")
        target.copy_(value if name in held else shards.local_part(name, value))


def _read(name: str, where: dict[str, Path], held: EPExperts | None = None,
          scheme: QuantScheme | None = None) -> torch.Tensor:
    """The tensor of model name ``name``: as named, DeepSeek-named, or per-expert stacked
    (dequantized where it has a scale, :func:`_weight`); ``held``: the EP experts module of a
    fused expert tensor (only its experts' rows)."""
    fused = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    if name not in where and fused is not None:
        prefix = expert_prefix(fused.group(1))
        parts = ("w1", "w3") if fused.group(2) == "gate_up_proj" else ("w2",)
        count = count_experts(prefix, where)
        check_expert_count(name, count, None if held is None else held.num_experts)
        experts = []
        for j in (range(count) if held is None else held.expert_ids):
            experts.append(torch.cat([_weight(f"{prefix}.{j}.{w}.weight", where, scheme)
                                      for w in parts]))
        return torch.stack(experts)
    if name in where and held is not None:
        return _get_rows(name, where, held)
    if name in where:
        return _weight(name, where, scheme)
    native = deepseek_name(name)
    if native not in where:
        raise CheckpointError(f"tensor {name} (DeepSeek name {native}) is not in the "
                              "checkpoint: config.json and weights disagree")
    return _weight(native, where, scheme)


_ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")


def _weight(key: str, where: dict[str, Path],
            scheme: QuantScheme | None = None) -> torch.Tensor:
    """Checkpoint tensor ``key``, dequantized to float32 when it has a scale: a routed expert
    of an ``expert_dtype: fp4`` checkpoint as MXFP4, any other weight as FP8 block."""
    value, scale = get_tensor(key, where), scale_of(key, where)
    if scale is None:
        fp8 = value.is_floating_point() and value.element_size() == 1
        if fp8 or (key.endswith(".weight") and not value.is_floating_point()):
            raise CheckpointError(
                f"checkpoint tensor {key} is {value.dtype} with no scale tensor ({key}_scale_inv"
                " or .scale): engine/v4 reads float weights, FP8 e4m3 ones with 128 x 128 "
                "block scales, or MXFP4 routed experts with e8m0 scales per 32; convert this "
                "tensor to bf16")
        return value
    if scheme is None:
        raise CheckpointError(f"{scale} (the scale of {key}) is in the checkpoint but "
                              "config.json has no quantization_config: give it the one the "
                              "checkpoint was written with (quant_method fp8, e4m3, "
                              "weight_block_size [128, 128]; expert_dtype fp4 when the "
                              "routed experts are packed FP4)")
    if scheme.expert_fp4 and _ROUTED.search(key):
        return _mxfp4(key, value, scale, where)
    if value.dtype != torch.float8_e4m3fn:
        raise CheckpointError(
            f"checkpoint tensor {key} is {value.dtype} {tuple(value.shape)} with scale "
            f"{scale}: engine/v4 dequantizes FP8 e4m3 block weights, and packed FP4 (MXFP4) "
            "routed experts (layers.*.ffn.experts.*.w1/w2/w3) only where config.json says "
            "expert_dtype fp4")
    s = get_tensor(scale, where)
    want = block_grid(*value.shape, scheme.block_size)
    if tuple(s.shape) != want:
        raise CheckpointError(f"checkpoint tensor {scale} has shape {tuple(s.shape)}; weight "
                              f"{key} {tuple(value.shape)} with weight_block_size "
                              f"{list(scheme.block_size)} needs {want}: config.json's "
                              "quantization_config does not match the checkpoint")
    return dequantize_block(value, s, scheme.block_size)


def _mxfp4(key: str, value: torch.Tensor, scale: str, where: dict[str, Path]) -> torch.Tensor:
    """Routed expert ``key`` (packed MXFP4 ``value``, scale tensor ``scale``) as float32."""
    if value.dtype not in PACKED_DTYPES:
        raise CheckpointError(
            f"checkpoint tensor {key} is {value.dtype} {tuple(value.shape)}: config.json's "
            "expert_dtype fp4 says the routed experts are packed MXFP4 (int8 / "
            "float4_e2m1fn_x2, two e2m1 per byte); drop expert_dtype if they are not")
    try:
        return dequantize_mxfp4(value, get_tensor(scale, where), MXFP4_BLOCK)
    except ValueError as e:
        raise CheckpointError(f"checkpoint tensor {key} / {scale}: {e}") from e


def _get_rows(key: str, where: dict[str, Path], held: EPExperts) -> torch.Tensor:
    """Rows ``held.expert_ids`` of the fused expert tensor ``key`` (only those are read)."""
    if key + "_scale_inv" in where:
        raise CheckpointError(f"{key} is a fused expert tensor with a block scale: engine/v4 "
                              "reads quantized experts per expert only (DeepSeek's "
                              "layers.*.ffn.experts.*.w1/w2/w3 names)")
    with safe_open(str(where[key]), framework="pt") as f:
        part = f.get_slice(key)
        check_expert_count(key, part.get_shape()[0], held.num_experts)
        return _unquantized(key, part[held.expert_ids.start:held.expert_ids.stop])


# NOTE: the dtypes a released V4 checkpoint stores FP8 linears and packed FP4 experts in; a
# model tensor is never one (the hash router's tid2eid is int32 / int64)
_QUANTIZED = {torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2,
              torch.float8_e8m0fnu, torch.float4_e2m1fn_x2}


def _unquantized(key: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` (rows of a fused expert tensor, read without a scale), or CheckpointError
    when it is stored quantized: per-expert weights with block scales go through
    :func:`_weight`."""
    if value.dtype in _QUANTIZED:
        raise CheckpointError(
            f"checkpoint tensor {key} is stored as {value.dtype}: a quantized DeepSeek-V4 "
            "checkpoint (FP8 linears / FP4 experts) although config.json has no "
            "quantization_config; engine/v4 loads unquantized weights only: use a bf16 "
            "checkpoint")
    return value

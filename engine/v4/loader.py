"""Load a DeepSeek-V4 checkpoint directory into :class:`engine.v4.model.DeepseekV4ForCausalLM`.

Two namings are read (per tensor, whichever the files hold): transformers' (the model's own
parameter names, experts fused ``gate_up_proj`` / ``down_proj``) and DeepSeek's released one
(``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{j}.w1.weight``, ``hc_head_fn``, ...,
the inverse of transformers' ``conversion_mapping`` for ``deepseek_v4``). ``mtp.*`` (the MTP
layer) is never read. An FP8 block checkpoint (DeepSeek-V4-Flash's linears:
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
from engine.quant.fp8_block import Fp8BlockExperts, Fp8BlockLinear, block_grid, dequantize_block
from engine.quant.linear import FP8_STORAGE
from engine.quant.mxfp4 import MXFP4_BLOCK, PACKED_DTYPES, Mxfp4Experts, dequantize_mxfp4
from engine.v4.config import V4Config
from engine.v4.expert_parallel import EPExperts
from engine.v4.model import DeepseekV4ForCausalLM, v4_rotaries
from engine.v4.stored import FP4, FP8, fill_experts, fill_linear, keep_quantized
from engine.v4.tp import V4Shards, check_tp

# transformers name (after ``model.layers.{i}.``) -> DeepSeek name, first match wins
_LAYER_NAMES = [
    (r"self_attn\.compressor\.indexer\.q_b_proj\.", "attn.indexer.wq_b."),
    (r"self_attn\.compressor\.indexer\.scorer\.weights_proj\.", "attn.indexer.weights_proj."),
    (r"self_attn\.compressor\.indexer\.", "attn.indexer.compressor."),
    (r"self_attn\.", "attn."), (r"mlp\.", "ffn."),
    (r"input_layernorm\.", "attn_norm."), (r"post_attention_layernorm\.", "ffn_norm."),
    (r"attn_hc\.", "hc_attn_"), (r"ffn_hc\.", "hc_ffn_")
]
_LEAF_NAMES = [
    (r"compressor\.(indexer\.)?kv_norm\.", r"compressor.\1norm."),
    (r"compressor\.(.*)kv_proj\.", r"compressor.\1wkv."),
    (r"compressor\.(.*)gate_proj\.", r"compressor.\1wgate."),
    (r"attn\.sinks$", "attn.attn_sink"), (r"position_bias$", "ape"),
    (r"q_a_proj\.", "wq_a."), (r"q_a_norm\.", "q_norm."),
    (r"attn\.q_b_proj\.", "attn.wq_b."), (r"attn\.kv_proj\.", "attn.wkv."),
    (r"o_a_proj\.", "wo_a."), (r"o_b_proj\.", "wo_b."),
    (r"gate\.e_score_correction_bias$", "gate.bias"),
    (r"shared_experts\.gate_proj\.", "shared_experts.w1."),
    (r"shared_experts\.up_proj\.", "shared_experts.w3."),
    (r"shared_experts\.down_proj\.", "shared_experts.w2."),
]
_TOP_NAMES = {"model.embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
              "model.norm.weight": "norm.weight", "model.hc_head.hc_fn": "hc_head_fn",
              "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def deepseek_name(name: str) -> str:
    """DeepSeek's released name of the model tensor ``name`` (fused experts excluded)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(name)
    rest = match.group(2)
    for pattern, repl in _LAYER_NAMES:
        if re.match(pattern, rest):
            rest = re.sub(pattern, repl, rest, count=1)
            break
    for pattern, repl in _LEAF_NAMES:
        rest = re.sub(pattern, repl, rest)
    if rest.startswith("hc_"):
        rest = rest.replace(".", "", 1)  # hc_attn_.fn -> hc_attn_fn
    return f"layers.{match.group(1)}.{rest}"


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
        where = _index(checkpoint_dir)
        keep_quantized(model, scheme, lambda name: _stored_scale(name, where) is not None,
                       _expert_storage(model, where, scheme))
    model.to_empty(device=device)
    with torch.device(device):
        model.rotary = v4_rotaries(config).to(dtype)
    load_v4_weights(model, checkpoint_dir, scheme)
    return model.eval()


def _index(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the ``*.safetensors`` file holding it.

    Raises:
        CheckpointError: no ``*.safetensors`` files.
    """
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {checkpoint_dir}")
    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            where.update({key: path for key in f.keys()})
    return where


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
    where = _index(checkpoint_dir)
    shards = V4Shards(model.config.o_groups, model.tp.size, model.tp.rank)
    done = _load_stored(model, where, shards)
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


def _load_stored(model: DeepseekV4ForCausalLM, where: dict[str, Path],
                 shards: V4Shards) -> set[str]:
    """Fill the modules :func:`engine.v4.stored.keep_quantized` swapped in, from the raw
    checkpoint tensors; the state-dict names filled."""
    done: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, Fp8BlockLinear):
            key = _key(f"{name}.weight", where)
            fill_linear(module, f"{name}.weight", _get(key, where),
                        _get(_scale_of(key, where), where), shards)
        elif isinstance(module, Fp8BlockExperts | Mxfp4Experts):
            experts = model.get_submodule(name.rpartition(".")[0])
            held = experts if isinstance(experts, EPExperts) else None
            block = module.block if isinstance(module, Fp8BlockExperts) else None
            q, scale = _stored_experts(name, where, held, block)
            fill_experts(module, name, q, scale, None if held is not None else shards)
        else:
            continue
        done.update(f"{name}.{b}" for b, _ in module.named_buffers())
    return done


def _key(name: str, where: dict[str, Path]) -> str:
    """The checkpoint key of model tensor ``name``: as named, or DeepSeek-named."""
    if name in where:
        return name
    native = deepseek_name(name)
    if native not in where:
        raise CheckpointError(f"tensor {name} (DeepSeek name {native}) is not in the "
                              "checkpoint: config.json and weights disagree")
    return native


def _stored_scale(name: str, where: dict[str, Path]) -> str | None:
    """The scale tensor of model weight ``name`` in the checkpoint (either naming), or None."""
    key = name if name in where else deepseek_name(name)
    return _scale_of(key, where) if key in where else None


def _expert_prefix(experts: str) -> str:
    """DeepSeek's prefix of the per-expert tensors of model module ``experts``
    (``model.layers.3.mlp.experts`` -> ``layers.3.ffn.experts``)."""
    return deepseek_name(experts + ".0.x").rsplit(".0.", 1)[0]


def _expert_storage(model: DeepseekV4ForCausalLM, where: dict[str, Path],
                    scheme: QuantScheme) -> str | None:
    """How the routed experts stay stored: FP4 (``expert_dtype: fp4``), FP8 (the first
    layer's first held expert has a block scale) or None (float)."""
    if scheme.expert_fp4:
        return FP4
    name, experts = next((n, m) for n, m in model.named_modules() if n.endswith("mlp.experts"))
    first = experts.expert_ids.start if isinstance(experts, EPExperts) else 0
    key = f"{_expert_prefix(name)}.{first}.w1.weight"
    return FP8 if key in where and _scale_of(key, where) is not None else None


def _stored_experts(name: str, where: dict[str, Path], held: EPExperts | None,
                    block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw per-expert weights and scales of fused parameter ``name`` (``...experts.
    gate_up_proj``: w1 then w3 rows; ``down_proj``: w2), stacked ``[E, ...]``; ``held``:
    only the EP rank's experts; ``block``: FP8's (None: MXFP4).

    Raises:
        CheckpointError: an expert weight without a scale (kept storage needs every one);
            an FP8 gate whose last scale block would hold up rows too.
    """
    prefix, part = name.rsplit(".", 1)
    native = _expert_prefix(prefix)
    count = _count(native, where)
    _check_count(name, count, held)
    weights, scales = [], []
    for j in range(count) if held is None else held.expert_ids:
        keys = [f"{native}.{j}.{w}.weight"
                for w in (("w1", "w3") if part == "gate_up_proj" else ("w2",))]
        qs, ss = zip(*(_raw_expert(k, where, block) for k in keys), strict=True)
        if block is not None and len(qs) == 2 and qs[0].shape[0] % block[0]:
            raise CheckpointError(
                f"{keys[0]}: its {qs[0].shape[0]} rows are not whole {block[0]}-row FP8 "
                f"blocks, so fused with {keys[1]} one scale block would span both: set "
                "model.fp8_storage: dequantize")
        weights.append(torch.cat(qs))
        scales.append(torch.cat(ss))
    return torch.stack(weights), torch.stack(scales)


def _read(name: str, where: dict[str, Path], held: EPExperts | None = None,
          scheme: QuantScheme | None = None) -> torch.Tensor:
    """The tensor of model name ``name``: as named, DeepSeek-named, or per-expert stacked
    (dequantized where it has a scale, :func:`_weight`); ``held``: the EP experts module of a
    fused expert tensor (only its experts' rows)."""
    fused = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    if name not in where and fused is not None:
        prefix = deepseek_name(fused.group(1) + ".0.x").rsplit(".0.", 1)[0]
        parts = ("w1", "w3") if fused.group(2) == "gate_up_proj" else ("w2",)
        count = _count(prefix, where)
        _check_count(name, count, held)
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


def _raw_expert(key: str, where: dict[str, Path],
                block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed expert weight ``key`` as stored and its scale, in the kept dtypes: FP8 (``block``
    given) e4m3 + float32 grid, MXFP4 packed bytes + e8m0 bytes, both uint8.

    Raises:
        CheckpointError: no scale, or another dtype than the storage kept (the message says
            to dequantize instead).
    """
    q, scale = _get(key, where), _scale_of(key, where)
    if scale is None:
        raise CheckpointError(f"checkpoint tensor {key} has no scale while other routed "
                              "experts do: kept quantized storage needs every expert "
                              "quantized alike (or model.fp8_storage: dequantize)")
    s = _get(scale, where)
    if block is not None and q.dtype == torch.float8_e4m3fn:
        return q, s.float()
    if block is None and q.dtype in PACKED_DTYPES and s.dtype in (torch.uint8,
                                                                  torch.float8_e8m0fnu):
        return q.view(torch.uint8), s.view(torch.uint8)
    want = "FP8 e4m3 with block scales" if block is not None else \
        "packed MXFP4 (int8 / uint8 / float4_e2m1fn_x2) with e8m0 scales"
    raise CheckpointError(f"checkpoint tensor {key} is {q.dtype} with a {s.dtype} scale; "
                          f"kept storage of these experts reads {want}: set "
                          "model.fp8_storage: dequantize")


def _count(prefix: str, where: dict[str, Path]) -> int:
    count = sum(1 for key in where if key.startswith(prefix + ".") and key.endswith(".w2.weight"))
    if count == 0:
        raise CheckpointError(f"no experts under {prefix} in the checkpoint")
    return count


def _check_count(name: str, count: int, held: EPExperts | None) -> None:
    if held is not None and count != held.num_experts:
        raise CheckpointError(f"{name}: the checkpoint has {count} experts, config.json's "
                              f"n_routed_experts is {held.num_experts}: they must agree")


def _get(key: str, where: dict[str, Path]) -> torch.Tensor:
    with safe_open(str(where[key]), framework="pt") as f:
        return f.get_tensor(key)  # NOTE: raw: _weight checks and dequantizes


def _scale_of(key: str, where: dict[str, Path]) -> str | None:
    """The name of weight ``key``'s block scale in the checkpoint, or None: ``<key>_scale_inv``
    (HF's FP8 naming), or for DeepSeek-named weights ``<module>.scale`` (the V4 release's;
    transformers' FP8 quantizer renames it to ``weight_scale_inv``). Non-weights have none
    (``hc_*_scale`` / ``attn_hc.scale`` are mHC parameters, not FP8 scales)."""
    if not key.endswith(".weight"):
        return None
    names = [key + "_scale_inv"]
    if not key.startswith("model."):
        names.append(key.removesuffix("weight") + "scale")
    return next((n for n in names if n in where), None)


_ROUTED = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")


def _weight(key: str, where: dict[str, Path],
            scheme: QuantScheme | None = None) -> torch.Tensor:
    """Checkpoint tensor ``key``, dequantized to float32 when it has a scale: a routed expert
    of an ``expert_dtype: fp4`` checkpoint as MXFP4, any other weight as FP8 block."""
    value, scale = _get(key, where), _scale_of(key, where)
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
    s = _get(scale, where)
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
        return dequantize_mxfp4(value, _get(scale, where), MXFP4_BLOCK)
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
        _check_count(key, part.get_shape()[0], held)
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

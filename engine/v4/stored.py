"""DeepSeek-V4 with ``model.fp8_storage: fp8``: the release's quantized weights kept as stored.

Which weights (decided per checkpoint, as V3's :func:`engine.quant.load.quant_plan`: a weight
is quantized when it has a scale tensor): every ``nn.Linear`` of the decoder layers whose
checkpoint weight has a block scale (DeepSeek-V4-Flash: attention ``wq_a`` / ``wq_b`` /
``wkv`` / ``wo_a`` / ``wo_b``, the indexer's ``wq_b``, the shared expert's ``w1`` / ``w2`` /
``w3``: :data:`RELEASE_FP8`) becomes V3's :class:`engine.quant.fp8_block.Fp8BlockLinear`
(e4m3 + one float32 scale per block, dequantized per use); the fused routed experts become
:class:`engine.quant.fp8_block.Fp8BlockExperts` when their per-expert weights are FP8 blocks,
or stay packed as :class:`engine.quant.mxfp4.Mxfp4Experts` under ``expert_dtype: fp4``.

NOTE (why FP4 experts stay FP4, not FP8): an MXFP4 weight is an e2m1 code times a power of two
per 32 inputs; re-blocking it to e4m3 with one scale per 128 x 128 is exact only while the
exponents inside a block span at most ~13 powers of two (e4m3's range with its 3-bit
mantissa), which nothing in the format promises; kept packed it is exact always (the same
numbers as dequantizing at load), 0.53 bytes a weight against FP8's 1.0 and bf16's 2 (what
the memory plan has always assumed for ``fp8_storage: fp8``), and dequantized per expert at
use like the FP8 ones.

Split: TP parts are the same chunks (:meth:`engine.v4.tp.V4Shards.local_part`) of the weight,
of its scale grid and of its packed bytes; a split whose pieces are not whole blocks (FP8:
``weight_block_size``, MXFP4: 32 inputs) is refused (:func:`block_cuts`). EP experts are
whole, so never cut.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.model_config import CheckpointError
from engine.parallel import EPGroup, TPGroup
from engine.quant.formats import QuantScheme
from engine.quant.fp8_block import Fp8BlockExperts, Fp8BlockLinear, block_grid
from engine.quant.mxfp4 import MXFP4_BLOCK, PACKED_DTYPES, Mxfp4Experts
from engine.v4.checkpoint import (check_expert_count, checkpoint_key, count_experts,
                                  deepseek_name, expert_prefix, get_tensor, scale_of)
from engine.v4.config import V4Config
from engine.v4.expert_parallel import EPExperts
from engine.v4.model import DeepseekV4ForCausalLM
from engine.v4.moe import Experts
from engine.v4.tp import V4Shards

FP8, FP4 = "fp8", "fp4"
RELEASE_FP8 = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|"
                         r"o_b_proj|compressor\.indexer\.q_b_proj)|mlp\.shared_experts\."
                         r"(gate_proj|up_proj|down_proj))\.weight")
"""The linears DeepSeek-V4-Flash's release stores FP8 (model names; the memory plan's and
:func:`block_cuts`' set: the engine goes by the checkpoint's scale tensors)."""
EXPERT_PARTS = ("gate_up_proj", "down_proj")


def keep_quantized(model: nn.Module, scheme: QuantScheme, scaled: Callable[[str], bool],
                   experts: str | None) -> None:
    """Swap the modules of ``model`` (built on the meta device, cast) whose checkpoint weights
    stay quantized, in place: each ``nn.Linear`` of ``model.model.layers`` whose weight
    ``scaled(name)`` says has a block scale for an :class:`Fp8BlockLinear`, and with
    ``experts`` (:data:`FP8` / :data:`FP4`; None: float) each layer's routed experts' fused
    stacks for :class:`Fp8BlockExperts` / :class:`Mxfp4Experts` (module doc)."""
    with torch.device("meta"):
        for name, parent in list(model.model.layers.named_modules(prefix="model.layers")):
            for child_name, child in list(parent.named_children()):
                full = f"{name}.{child_name}"
                if isinstance(child, nn.Linear) and scaled(f"{full}.weight"):
                    setattr(parent, child_name, Fp8BlockLinear(
                        child.in_features, child.out_features, scheme.block_size))
                elif isinstance(child, Experts) and experts is not None:
                    _keep_experts(child, experts, scheme.block_size)


def _keep_experts(module: Experts, kind: str, block: tuple[int, int]) -> None:
    for part in EXPERT_PARTS:
        n, out, inp = getattr(module, part).shape
        delattr(module, part)  # NOTE: a Parameter slot takes no module
        setattr(module, part, Fp8BlockExperts(n, out, inp, block) if kind == FP8
                else Mxfp4Experts(n, out, inp))


def fill_linear(module: Fp8BlockLinear, name: str, q: torch.Tensor, scale: torch.Tensor,
                shards: V4Shards) -> None:
    """This rank's part of checkpoint weight ``name`` (``q`` e4m3 whole, ``scale`` its whole
    block grid, float32 or e8m0) into ``module``.

    Raises:
        CheckpointError: ``q`` not e4m3; a whole shape other than the config's; a scale grid
            other than ``weight_block_size``'s; a TP split that cuts a block.
    """
    _check_fp8(name, q, scale, module.block)
    _check_whole(name, tuple(q.shape), shards.full_shape(name, tuple(module.weight.shape)))
    _check_whole_blocks(name, shards, tuple(module.weight.shape), dict(enumerate(module.block)))
    module.weight.copy_(shards.local_part(name, q))
    module.weight_scale_inv.copy_(shards.local_part(name, scale.float()))


def fill_experts(module: Fp8BlockExperts | Mxfp4Experts, name: str, q: torch.Tensor,
                 scale: torch.Tensor, shards: V4Shards | None) -> None:
    """Stacked expert weights ``q [E, out, in]`` (MXFP4: ``[E, out, in / 2]`` packed) and
    their scales into ``module`` (fused parameter ``name``, e.g.
    ``model.layers.0.mlp.experts.gate_up_proj``); ``shards``: this TP rank's part, None for
    EP experts (whole).

    Raises:
        CheckpointError: as :func:`fill_linear` (MXFP4: packed dtype, e8m0 scales, 32-wide
            pieces).
    """
    local = tuple(module.weight.shape)
    if isinstance(module, Fp8BlockExperts):
        _check_fp8(name, q, scale, module.block)
        factors, dense, local_dense = {1: module.block[0], 2: module.block[1]}, q.shape, local
    else:
        if q.dtype not in PACKED_DTYPES or scale.dtype not in (torch.uint8,
                                                                torch.float8_e8m0fnu):
            raise CheckpointError(f"{name}: packed MXFP4 experts with e8m0 scales are kept "
                                  f"as stored; the checkpoint has {q.dtype} / {scale.dtype}: "
                                  "set model.fp8_storage: dequantize")
        q, scale = q.view(torch.uint8), scale.view(torch.uint8)
        factors = {2: MXFP4_BLOCK}
        dense, local_dense = (*q.shape[:-1], 2 * q.shape[-1]), (*local[:-1], 2 * local[-1])
    if isinstance(module, Fp8BlockExperts):
        scale = scale.float()
    if shards is None:  # NOTE: EP experts are whole on their rank
        _check_whole(name, tuple(dense), tuple(local_dense))
        module.weight.copy_(q)
        module_scale(module).copy_(scale)
        return
    _check_whole(name, tuple(dense), shards.full_shape(name, tuple(local_dense)))
    _check_whole_blocks(name, shards, tuple(local_dense), factors)
    module.weight.copy_(shards.local_part(name, q))
    module_scale(module).copy_(shards.local_part(name, scale))


def module_scale(module: Fp8BlockExperts | Mxfp4Experts) -> torch.Tensor:
    """The scale buffer of a quantized expert stack."""
    return module.weight_scale_inv if isinstance(module, Fp8BlockExperts) else module.scale


def _check_fp8(name: str, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> None:
    if q.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"checkpoint tensor {name} is {q.dtype} with a block scale: "
                              "FP8 storage keeps e4m3 block weights only")
    want = (*q.shape[:-2], *block_grid(q.shape[-2], q.shape[-1], block))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"the scale of {name} has shape {tuple(scale.shape)}; weight "
                              f"{tuple(q.shape)} with weight_block_size {list(block)} needs "
                              f"{want}: config.json's quantization_config does not match "
                              "the checkpoint")


def _check_whole(name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise CheckpointError(f"checkpoint tensor {name} has shape {got}; the config implies "
                              f"{want}")


def _check_whole_blocks(name: str, shards: V4Shards, local: tuple[int, ...],
                        factors: dict[int, int]) -> None:
    """CheckpointError unless every piece the TP split cuts ``name`` into is whole blocks."""
    for dim, piece in shards.pieces(name, local).items():
        block = factors.get(dim, 1)
        if piece % block:
            raise CheckpointError(
                f"{name}: tp={shards.tp} cuts it into pieces of {piece} along dim {dim}, not "
                f"whole {block}-wide quantization blocks, so it cannot stay quantized: set "
                "model.fp8_storage: dequantize, or a tp whose parts are whole blocks")


def block_cuts(config: V4Config, tp: int, ep: bool, scheme: QuantScheme,
               experts: str | None) -> list[str]:
    """The release's quantized weights (:data:`RELEASE_FP8`; the routed experts, ``experts``
    :data:`FP8` / :data:`FP4` / None: float, unless ``ep``) that TP size ``tp`` cuts inside
    a block, one ``"name: pieces of n along dim d, not whole b-wide blocks"`` each
    (``layers.*.`` names; empty: every split keeps whole blocks). Shapes from the engine's
    own modules (a meta build of TP rank 0; ``tp`` must pass :func:`engine.v4.tp.check_tp`)."""
    with torch.device("meta"):
        model = _meta_model(config, tp, ep)
    shards = V4Shards(config.o_groups, tp, 0)
    rows = [(n, tuple(p.shape), dict(enumerate(scheme.block_size)))
            for n, p in model.named_parameters() if RELEASE_FP8.fullmatch(n)]
    if not ep and experts is not None:
        factors = {2: MXFP4_BLOCK} if experts == FP4 else \
            {1: scheme.block_size[0], 2: scheme.block_size[1]}
        rows += [(n, tuple(p.shape), factors) for n, p in model.named_parameters()
                 if n.endswith(tuple(f"mlp.experts.{part}" for part in EXPERT_PARTS))]
    out = {}
    for name, local, factors in rows:
        for dim, piece in shards.pieces(name, local).items():
            if piece % factors.get(dim, 1):
                out.setdefault(re.sub(r"layers\.\d+\.", "layers.*.", name),
                               f"pieces of {piece} along dim {dim}, not whole "
                               f"{factors[dim]}-wide blocks")
    return [f"{name}: {why}" for name, why in out.items()]


def _meta_model(config: V4Config, tp: int, ep: bool) -> nn.Module:
    return DeepseekV4ForCausalLM(config, TPGroup(rank=0, size=tp),
                                 EPGroup(rank=0, size=config.n_routed_experts) if ep else None)


def load_stored(model: DeepseekV4ForCausalLM, where: dict[str, Path],
                shards: V4Shards) -> set[str]:
    """Fill the modules :func:`keep_quantized` swapped in from the raw checkpoint tensors
    (``where``: :func:`engine.v4.checkpoint.index_tensors`); return the state-dict names
    filled (the loader fills the rest).

    Raises:
        CheckpointError: from :func:`fill_linear`, :func:`fill_experts` and the expert reads
            (a routed expert without a scale or of another format than its layer's).
    """
    done: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, Fp8BlockLinear):
            key = checkpoint_key(f"{name}.weight", where)
            fill_linear(module, f"{name}.weight", get_tensor(key, where),
                        get_tensor(scale_of(key, where), where), shards)
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


def stored_scale(name: str, where: dict[str, Path]) -> str | None:
    """The scale tensor of model weight ``name`` in the checkpoint (either naming), or None."""
    key = name if name in where else deepseek_name(name)
    return scale_of(key, where) if key in where else None


def expert_storage(model: DeepseekV4ForCausalLM, where: dict[str, Path],
                   scheme: QuantScheme) -> str | None:
    """How the routed experts stay stored: FP4 (``expert_dtype: fp4``), FP8 (the first
    layer's first held expert has a block scale) or None (float)."""
    if scheme.expert_fp4:
        return FP4
    name, experts = next((n, m) for n, m in model.named_modules() if n.endswith("mlp.experts"))
    first = experts.expert_ids.start if isinstance(experts, EPExperts) else 0
    key = f"{expert_prefix(name)}.{first}.w1.weight"
    return FP8 if key in where and scale_of(key, where) is not None else None


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
    native = expert_prefix(prefix)
    count = count_experts(native, where)
    check_expert_count(name, count, None if held is None else held.num_experts)
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


def _raw_expert(key: str, where: dict[str, Path],
                block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed expert weight ``key`` as stored and its scale, in the kept dtypes: FP8 (``block``
    given) e4m3 + float32 grid, MXFP4 packed bytes + e8m0 bytes, both uint8.

    Raises:
        CheckpointError: no scale, or another dtype than the storage kept (the message says
            to dequantize instead).
    """
    q, scale = get_tensor(key, where), scale_of(key, where)
    if scale is None:
        raise CheckpointError(f"checkpoint tensor {key} has no scale while other routed "
                              "experts do: kept quantized storage needs every expert "
                              "quantized alike (or model.fp8_storage: dequantize)")
    s = get_tensor(scale, where)
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

"""Fill a model's quantized (and to-be-dequantized) linear weights from a quantized checkpoint.

For every module, the tensors it needs are read by name from whichever shard holds them, only
this rank's part (:func:`engine.layout.rule_for`); the scale's part follows the weight's (same
rows for per-channel scales, the covering blocks for block scales). The generic loader
(:func:`engine.loader.load_weights`) loads the rest and skips the names returned here.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.layout import TPLayout, rule_for
from engine.model_config import CheckpointError
from engine.parallel import TPGroup
from engine.quant.formats import FP8_BLOCK, SCALE_SUFFIX, QuantScheme
from engine.quant.fp8_block import Fp8BlockLinear, dequantize_block
from engine.quant.linear import Int8Linear, QuantPlan, W8A8MLP

Span = tuple[int, int]  # [start, stop) along one dim


@dataclass(frozen=True)
class RankPart:
    """Which part of each checkpoint tensor this rank holds: its TP rank in ``layout``."""

    tp_rank: int
    layout: TPLayout


class CheckpointTensors:
    """Random access to the tensors of all ``*.safetensors`` files of a folder (a context
    manager: files stay open until exit)."""

    def __init__(self, checkpoint_dir: Path) -> None:
        self.dir = checkpoint_dir
        self._stack = ExitStack()
        self._files: dict[str, object] = {}
        for path in sorted(checkpoint_dir.glob("*.safetensors")):
            f = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._files.update((name, f) for name in f.keys())

    def __enter__(self) -> CheckpointTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> list[str]:
        return list(self._files)

    def has(self, name: str) -> bool:
        return name in self._files

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name`` (CheckpointError: no shard holds it)."""
        if name not in self._files:
            raise CheckpointError(f"{name} is missing from {self.dir}: the quantized model "
                                  "needs it (is quantization_config right for these tensors?)")
        return tuple(self._files[name].get_slice(name).get_shape())

    def read(self, name: str, spans: list[Span]) -> torch.Tensor:
        """``tensor[spans]`` read from disk (only that part)."""
        self.shape(name)
        return self._files[name].get_slice(name)[tuple(slice(a, b) for a, b in spans)]


def scale_name(weight_name: str, scheme: QuantScheme) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (FP8) or ``x.weight_scale`` (W8A8)."""
    return weight_name.removesuffix("weight") + scheme.scale_suffix


def quant_plan(checkpoint_dir: str | Path, scheme: QuantScheme | None,
               fp8_storage: str = "dequantize") -> QuantPlan | None:
    """Which weights of the checkpoint are stored quantized (those with a scale tensor).

    Raises:
        ValueError: ``fp8_storage`` is not "dequantize" or "fp8".
    """
    if scheme is None:
        return None
    with CheckpointTensors(Path(checkpoint_dir)) as tensors:
        names = set(tensors.names())
    suffix = scheme.scale_suffix
    quantized = frozenset(n.removesuffix(suffix) + "weight" for n in names if n.endswith(suffix))
    return QuantPlan(scheme, quantized, fp8_storage)


def load_quantized(model: nn.Module, checkpoint_dir: str | Path, tp: TPGroup,
                   skip: frozenset[str] = frozenset()) -> set[str]:
    """Load every quantized module, and every float ``nn.Linear`` whose checkpoint weight is
    quantized (dequantized to its dtype) unless its weight is in ``skip`` (a layer-sharded
    weight another CP rank stores: never read); return the float parameter names filled.

    Raises:
        CheckpointError: a weight or scale is missing or has the wrong shape or dtype; scale
            tensors of a format other than config.json's ``quantization_config``; an FP8
            TP shard that does not start on a block boundary with ``fp8_storage: fp8``.
    """
    scheme: QuantScheme | None = model.config.quantization
    with CheckpointTensors(Path(checkpoint_dir)) as tensors:
        _refuse_foreign_scales(tensors, scheme)
        if scheme is None:
            return set()
        part = RankPart(tp.rank, model.layout)
        loaded: set[str] = set()
        for name, module in model.named_modules():
            if isinstance(module, W8A8MLP):
                for proj, (w, s) in module.checkpoint_parts().items():
                    _load_int8(tensors, f"{name}.{proj}.weight", w, s, scheme, part)
            elif isinstance(module, Int8Linear):
                _load_int8(tensors, f"{name}.weight", module.weight, module.weight_scale,
                           scheme, part)
            elif isinstance(module, Fp8BlockLinear):
                _load_fp8(tensors, f"{name}.weight", module, scheme, part)
            elif isinstance(module, nn.Linear) and f"{name}.weight" not in skip \
                    and tensors.has(scale_name(f"{name}.weight", scheme)):
                _load_dequantized(tensors, f"{name}.weight", module.weight, scheme, part)
                loaded.add(f"{name}.weight")
    return loaded


def _refuse_foreign_scales(tensors: CheckpointTensors, scheme: QuantScheme | None) -> None:
    """Scale tensors of a format other than config.json's (or of any, with none) are an error:
    their weights would be read as plain numbers."""
    mine = scheme.scale_suffix if scheme is not None else None
    foreign = [n for n in tensors.names()
               if n.endswith(tuple(SCALE_SUFFIX.values())) and not (mine and n.endswith(mine))]
    if foreign:
        said = f"says {scheme.method}" if scheme is not None else "has no quantization_config"
        raise CheckpointError(f"{foreign[0]} (and {len(foreign) - 1} more such scale tensors) "
                              f"in {tensors.dir}, but config.json {said}: give config.json the "
                              "quantization_config the checkpoint was written with")


def _local_spans(tensors: CheckpointTensors, weight_name: str, local_shape: tuple[int, ...],
                 part: RankPart) -> list[Span]:
    """This rank's ``[start, stop)`` per dim of the checkpoint weight (shape checked)."""
    rule = rule_for(weight_name)
    full = tensors.shape(weight_name)
    expected = rule.full_shape(local_shape, part.layout)
    if full != expected:
        raise CheckpointError(f"checkpoint tensor {weight_name} has shape {full}; the config "
                              f"implies {expected}: config.json and weights disagree")
    index = rule.local_slices(full, part.tp_rank, part.layout)
    return [(s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, full)]


def _read_weight(tensors: CheckpointTensors, name: str, spans: list[Span],
                 dtype: torch.dtype) -> torch.Tensor:
    q = tensors.read(name, spans)
    if q.dtype != dtype:
        raise CheckpointError(f"checkpoint tensor {name} is {q.dtype}; its quantization_config "
                              f"says {dtype}: the checkpoint and its config.json disagree")
    return q


def _read_scale(tensors: CheckpointTensors, weight_name: str, scheme: QuantScheme,
                spans: list[Span]) -> torch.Tensor:
    """``spans`` of the scale of ``weight_name``, after checking its full shape against the
    weight's: ``[ceil(out/b0), ceil(in/b1)]`` for FP8 blocks, ``[out, 1]`` for W8A8.

    Raises:
        CheckpointError: the shapes disagree (e.g. a ``weight_block_size`` other than the one
            the checkpoint was written with).
    """
    name = scale_name(weight_name, scheme)
    out, inp = tensors.shape(weight_name)
    if scheme.method == FP8_BLOCK:
        b0, b1 = scheme.block_size
        want, why = (-(-out // b0), -(-inp // b1)), f"weight_block_size {[b0, b1]}"
    else:
        want, why = (out, 1), "one scale per output channel"
    got = tensors.shape(name)
    if got != want:
        raise CheckpointError(
            f"checkpoint tensor {name} has shape {got}; weight {weight_name} {(out, inp)} with "
            f"{why} needs {want}: config.json's quantization_config does not match how the "
            "checkpoint was written")
    return tensors.read(name, spans)


def _load_int8(tensors: CheckpointTensors, name: str, weight: torch.Tensor,
               scale: torch.Tensor, scheme: QuantScheme, part: RankPart) -> None:
    """Int8 weight part + its rows of the per-channel scale ``[out, 1]``."""
    spans = _local_spans(tensors, name, tuple(weight.shape), part)
    weight.copy_(_read_weight(tensors, name, spans, torch.int8))
    scale.copy_(_read_scale(tensors, name, scheme, [spans[0], (0, 1)]).float())


def _load_fp8(tensors: CheckpointTensors, name: str, module: Fp8BlockLinear,
              scheme: QuantScheme, part: RankPart) -> None:
    """FP8 weight part + the scale blocks covering it (the part must be block aligned)."""
    spans = _local_spans(tensors, name, tuple(module.weight.shape), part)
    full = tensors.shape(name)
    for (start, stop), b, n in zip(spans, scheme.block_size, full):
        if start % b or (stop % b and stop != n):
            raise CheckpointError(
                f"{name}: this TP rank's part [{start}, {stop}) of a dim of {n} does not "
                f"start and end on {b}-wide FP8 blocks, so it cannot keep FP8 storage: set "
                "model.fp8_storage: dequantize, or a tp whose shards are block multiples")
    grid = [(start // b, -(-stop // b)) for (start, stop), b in zip(spans, scheme.block_size)]
    module.weight.copy_(_read_weight(tensors, name, spans, torch.float8_e4m3fn))
    module.weight_scale_inv.copy_(_read_scale(tensors, name, scheme, grid).float())


def _load_dequantized(tensors: CheckpointTensors, name: str, weight: torch.Tensor,
                      scheme: QuantScheme, part: RankPart) -> None:
    """Quantized checkpoint weight part -> float ``weight`` (dequantized in float32)."""
    spans = _local_spans(tensors, name, tuple(weight.shape), part)
    if scheme.method == FP8_BLOCK:
        q = _read_weight(tensors, name, spans, torch.float8_e4m3fn)
        grid = [(start // b, -(-stop // b)) for (start, stop), b in zip(spans, scheme.block_size)]
        offset = (spans[0][0] % scheme.block_size[0], spans[1][0] % scheme.block_size[1])
        w = dequantize_block(q, _read_scale(tensors, name, scheme, grid), scheme.block_size,
                             offset)
    else:
        q = _read_weight(tensors, name, spans, torch.int8)
        w = q.float() * _read_scale(tensors, name, scheme, [spans[0], (0, 1)]).float()
    weight.copy_(w)

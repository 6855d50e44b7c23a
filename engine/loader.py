"""Load a HF checkpoint's ``*.safetensors`` into a :class:`DeepseekForCausalLM`, TP-sharded.

Experts may be stored per expert (transformers 4.x, DeepSeek's releases:
``mlp.experts.{j}.{gate,up,down}_proj.weight``) or fused (transformers 5.x:
``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``, split here). Only
the slice :func:`engine.layout.rule_for` names is read; tensors the model lacks (e.g. the MTP
layer) are never read. Quantized weights and scales go first through
:func:`engine.quant.load.load_quantized`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.layout import rule_for
from engine.model import DeepseekForCausalLM
from engine.model_config import CheckpointError
from engine.parallel import TPGroup
from engine.quant.load import load_quantized

_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


Reader = Callable[[tuple[slice, ...]], torch.Tensor]


def _checkpoint_entries(checkpoint_dir: Path) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """(name, full shape, reader) of every checkpoint tensor, fused expert tensors split.

    ``reader(index)`` returns ``tensor[index]`` (only that part read for per-tensor entries).
    NOTE: call it before requesting the next entry (the file is open only while iterating).
    """
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {checkpoint_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                fused = _FUSED.match(name)
                if fused is None:
                    sl = f.get_slice(name)
                    yield name, tuple(sl.get_shape()), sl.__getitem__
                else:
                    yield from _split_fused(fused.group(1), fused.group(2), f.get_tensor(name))


def _split_fused(prefix: str, kind: str,
                 t: torch.Tensor) -> Iterator[tuple[str, tuple[int, ...], Reader]]:
    """Per-expert entries from ``gate_up_proj [E, 2I, H]`` or ``down_proj [E, H, I]``."""
    for j in range(t.shape[0]):
        if kind == "down_proj":
            parts = {"down_proj": t[j]}
        else:
            gate, up = t[j].chunk(2, dim=0)
            parts = {"gate_proj": gate, "up_proj": up}
        for proj, part in parts.items():
            yield f"{prefix}.{j}.{proj}.weight", tuple(part.shape), part.__getitem__


def load_weights(model: DeepseekForCausalLM, checkpoint_dir: str | Path, tp: TPGroup,
                 skip: frozenset[str] = frozenset()) -> None:
    """Copy the checkpoint into ``model`` (its parameters hold this rank's shards, laid out by
    ``model.layout``). Routed experts another EP rank owns are not in ``model``: never read;
    nor are the parameters named in ``skip`` (layer-sharded weights another CP rank stores,
    :mod:`engine.layer_sharding`). Vocab padding rows (last TP rank) are zeroed.

    Raises:
        CheckpointError: a model tensor is missing from the checkpoint, or a checkpoint tensor
            has a shape other than the full (unsharded) shape the config implies; the message
            names the tensor and the expected shape.
    """
    params, layout = dict(model.named_parameters()), model.layout
    tied = model.config.tie_word_embeddings
    if tied:
        params.pop("lm_head.weight")
    with torch.no_grad():  # quantized modules, and float weights stored quantized
        loaded = load_quantized(model, checkpoint_dir, tp, skip)
    for name, shape, read in _checkpoint_entries(Path(checkpoint_dir)):
        param = params.get(name)
        if param is None or name in loaded or name in skip:
            continue  # not part of this model (MTP layer, scales, ...) or loaded: never read
        rule = rule_for(name)
        expected = rule.full_shape(tuple(param.shape), layout)
        if shape != expected:
            raise CheckpointError(f"checkpoint tensor {name} has shape {shape}; the config "
                                  f"implies {expected}: config.json and weights disagree")
        _copy_padded(param, read(rule.local_slices(shape, tp.rank, layout)))
        loaded.add(name)
    missing = sorted(set(params) - loaded - skip)
    if missing:
        shown = ", ".join(f"{n} {rule_for(n).full_shape(tuple(params[n].shape), layout)}"
                          for n in missing[:5])
        raise CheckpointError(f"{len(missing)} tensors missing from {checkpoint_dir}: {shown}"
                              + (" ..." if len(missing) > 5 else ""))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight


def _copy_padded(param: torch.Tensor, piece: torch.Tensor) -> None:
    """``param[:len(piece)] = piece``, the rest (vocab padding) zero."""
    with torch.no_grad():
        if piece.shape[0] < param.shape[0]:
            param[piece.shape[0]:].zero_()
        param[:piece.shape[0]].copy_(piece)

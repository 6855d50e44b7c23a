"""Load a HF checkpoint's ``*.safetensors`` into a :class:`DeepseekForCausalLM`, TP-sharded.

Accepted expert layouts:
- per expert (transformers 4.x, DeepSeek's released checkpoints):
  ``model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight``;
- fused (transformers 5.x ``save_pretrained``): ``mlp.experts.gate_up_proj [E, 2I, H]`` and
  ``mlp.experts.down_proj [E, H, I]``, split per expert here.

Sharding (TP rank r of n takes slice r of the sharded dim): rows of ``q_proj``, ``q_b_proj``,
``kv_b_proj`` (head-major, so by heads) and of every ``gate_proj``/``up_proj``; columns of
``o_proj`` and every ``down_proj``. Everything else is replicated. Tensors the model does not
have (e.g. the MTP layer ``model.layers.{num_hidden_layers}.*``) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from orch.engine.model import DeepseekForCausalLM
from orch.engine.parallel import TPGroup

_ROW_SHARDED = re.compile(r"\.(q_proj|q_b_proj|kv_b_proj|gate_proj|up_proj)\.weight$")
_COL_SHARDED = re.compile(r"\.(o_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, has the wrong shape, or is in an unsupported format."""


def shard_dim(name: str) -> int | None:
    """The dim TP shards parameter ``name`` along (0 rows, 1 columns), or None (replicated)."""
    if _ROW_SHARDED.search(name):
        return 0
    if _COL_SHARDED.search(name):
        return 1
    return None


def _checkpoint_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of every ``*.safetensors`` file, expert-fused ones split."""
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {checkpoint_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith("weight_scale_inv"):
                    raise CheckpointError(
                        f"{name} in {path.name}: FP8 block-quantized checkpoints are not "
                        "supported yet; convert to bf16 first (DeepSeek's fp8_cast_bf16.py)")
                fused = _FUSED.match(name)
                if fused is None:
                    yield name, f.get_tensor(name)
                else:
                    yield from _split_fused(fused.group(1), fused.group(2), f.get_tensor(name))


def _split_fused(prefix: str, kind: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert tensors from ``gate_up_proj [E, 2I, H]`` or ``down_proj [E, H, I]``."""
    for j in range(t.shape[0]):
        if kind == "down_proj":
            yield f"{prefix}.{j}.down_proj.weight", t[j]
        else:
            gate, up = t[j].chunk(2, dim=0)
            yield f"{prefix}.{j}.gate_proj.weight", gate
            yield f"{prefix}.{j}.up_proj.weight", up


def _full_shape(name: str, local: torch.Size, tp: TPGroup) -> tuple[int, ...]:
    dim = shard_dim(name)
    shape = list(local)
    if dim is not None and tp.size > 1:
        shape[dim] *= tp.size
    return tuple(shape)


def load_weights(model: DeepseekForCausalLM, checkpoint_dir: str | Path, tp: TPGroup) -> None:
    """Copy the checkpoint into ``model`` (its parameters hold this rank's shards).

    Raises:
        CheckpointError: a model tensor is missing from the checkpoint, or a checkpoint tensor
            has a shape other than the full (unsharded) shape the config implies; the message
            names the tensor and the expected shape.
    """
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    if tied:
        params.pop("lm_head.weight")
    loaded: set[str] = set()
    for name, tensor in _checkpoint_tensors(Path(checkpoint_dir)):
        param = params.get(name)
        if param is None:
            continue  # not part of this model (MTP layer, rotary inv_freq, ...)
        expected = _full_shape(name, param.shape, tp)
        if tuple(tensor.shape) != expected:
            raise CheckpointError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}; "
                                  f"the config implies {expected}: config.json and weights "
                                  "disagree")
        dim = shard_dim(name)
        if dim is not None and tp.size > 1:
            tensor = tensor.chunk(tp.size, dim=dim)[tp.rank]
        with torch.no_grad():
            param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        shown = ", ".join(f"{n} {_full_shape(n, params[n].shape, tp)}" for n in missing[:5])
        raise CheckpointError(f"{len(missing)} tensors missing from {checkpoint_dir}: {shown}"
                              + (" ..." if len(missing) > 5 else ""))
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight

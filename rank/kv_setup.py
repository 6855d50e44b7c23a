"""Builds the KV transfer objects a rank needs from its instance config and model runner."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from engine.v4.staging import StagingSpec
from kv_transfer.config import TransferConfig
from rank.config import InstanceConfig


def model_identity(checkpoint_dir: str) -> str:
    """``model_type`` plus a hash of the checkpoint's config.json (key order ignored): equal on
    every node that loads the same model, whatever its path."""
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return f"{config.get('model_type', 'unknown')}-{digest}"


def make_layout(runner, cfg: InstanceConfig):
    """The rank's :class:`kv_transfer.KVLayout` (what the handshake fingerprints): of its
    ``KVCacheSpec``, or of DeepSeek-V4's staging rows (:func:`staged_layout`)."""
    from kv_transfer.layout import KVLayout

    model, tp = model_identity(cfg.checkpoint_dir), cfg.parallel.tp
    if isinstance(runner.kv_spec, StagingSpec):
        return staged_layout(runner.kv_spec, model, tp)
    return KVLayout.from_spec(runner.kv_spec, model, tp)


def staged_layout(spec: StagingSpec, model: str, tp: int):
    """The :class:`kv_transfer.KVLayout` of DeepSeek-V4 staging rows: one buffer per tier
    (``BufferSpec.layers``: the layers having it, when not all), the V4 specs in
    ``layer_specs`` (a prefill and a decode of other V4 specs are refused at the pair
    handshake, naming it); docs/kv_transfer.md "DeepSeek-V4: staged per-layer state"."""
    from kv_transfer.layout import BufferSpec, KVLayout

    buffers = tuple(BufferSpec(name, (width,), None if len(layers) == spec.num_layers else layers)
                    for name, (width, layers) in zip(spec.buffer_names, spec.tiers))
    return KVLayout(model=model, kind="mla", buffers=buffers, num_kv_heads=None,
                    dtype=str(spec.dtype).removeprefix("torch."), num_layers=spec.num_layers,
                    block_size=spec.block_size, tp=tp, rope_layout="interleaved",
                    layer_specs=spec.layer_specs)


def stretch_completion(transfer: TransferConfig, factor: float) -> TransferConfig:
    """``transfer`` with ``completion_timeout_s`` multiplied by ``factor``.

    The decode receiver's clock starts at the reservation, which may wait in the prefill queue
    for a long time, so decode gives its receivers the orphan bound and enforces
    ``completion_timeout_s`` itself from the first token on.
    """
    return replace(transfer, completion_timeout_s=transfer.completion_timeout_s * factor)

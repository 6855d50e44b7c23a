"""Builds the KV transfer objects a rank needs from its instance config and model runner."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

from kv_transfer.config import TransferConfig
from rank.config import InstanceConfig


def model_identity(checkpoint_dir: str) -> str:
    """``model_type`` plus a hash of the checkpoint's config.json (key order ignored): equal on
    every node that loads the same model, whatever its path."""
    config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return f"{config.get('model_type', 'unknown')}-{digest}"


def make_layout(runner, cfg: InstanceConfig):
    """The rank's :class:`kv_transfer.KVLayout` (what the handshake fingerprints); a runner
    with its own (DeepSeek-V4's staging rows, ``transfer_layout``) gives it."""
    from kv_transfer.layout import KVLayout

    if hasattr(runner, "transfer_layout"):
        return runner.transfer_layout(model_identity(cfg.checkpoint_dir), cfg.parallel.tp)

    return KVLayout.from_spec(runner.kv_spec, model_identity(cfg.checkpoint_dir),
                              cfg.parallel.tp)


def stretch_completion(transfer: TransferConfig, factor: float) -> TransferConfig:
    """``transfer`` with ``completion_timeout_s`` multiplied by ``factor``.

    The decode receiver's clock starts at the reservation, which may wait in the prefill queue
    for a long time, so decode gives its receivers the orphan bound and enforces
    ``completion_timeout_s`` itself from the first token on.
    """
    return replace(transfer, completion_timeout_s=transfer.completion_timeout_s * factor)

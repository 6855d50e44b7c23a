"""Builds the KV transfer objects a rank needs from its instance config and model runner."""

from __future__ import annotations

from orch.messages import InstanceConfig


def make_layout(runner, cfg: InstanceConfig):
    """The rank's :class:`orch.kv_transfer.KVLayout` (what the handshake fingerprints)."""
    from orch.kv_transfer import KVLayout

    return KVLayout.from_spec(runner.kv_spec, model_id=runner.model_id, tp=cfg.tp)


def make_transfer_config(cfg: InstanceConfig):
    """The rank's :class:`orch.kv_transfer.TransferConfig` (bounded waits, seconds)."""
    from orch.kv_transfer import TransferConfig

    return TransferConfig(connect_timeout_s=cfg.connect_timeout_s,
                          header_timeout_s=cfg.header_timeout_s,
                          payload_timeout_s=cfg.payload_timeout_s,
                          completion_timeout_s=cfg.completion_timeout_s)

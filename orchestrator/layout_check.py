"""Does each role's ``tp`` fit the served model? Checked when the config is loaded and by
``orch up --dry-run``, before anything starts.

The check is the engine's own (:func:`engine.layout.tp_layout`, the one the ranks run when they
load their shard), applied to the checkpoint's ``config.json``, or to the built-in tiny config
when ``model.path`` is ``tiny`` and the checkpoint is not made yet. With neither at hand (or a
``config.json`` the engine cannot read) nothing is checked here and the report says why; the
ranks still check at load.
"""

from __future__ import annotations

from orchestrator.checkpoint import model_config_dict
from orchestrator.config import OrchConfig
from orchestrator.config_errors import ConfigError


def _role_tp_keys(cfg: OrchConfig) -> list[tuple[str, int]]:
    """(key path, tp) of every role that runs: ``prefill.tp`` and ``decode.tp``, or only
    ``decode.tp`` in colocated mode (colocated instances are sized by the decode section)."""
    keys = [("decode.tp", cfg.decode.tp)]
    return [("prefill.tp", cfg.prefill.tp)] + keys if cfg.mode == "disaggregated" else keys


def check_tp_layout(cfg: OrchConfig) -> str:
    """Check every role's tp against the model; returns one report line saying what was
    checked against what (or why nothing was).

    Raises:
        ConfigError: a tp does not divide a size the layout splits (attention heads, dense or
            expert intermediate size); the message names the key path and the tp sizes that
            work.
    """
    raw, source = model_config_dict(cfg.model)
    if raw is None:
        return f"tp layout: not checked ({source})"
    try:
        from engine.layout import tp_layout  # lazy: torch
        from engine.model_config import ModelConfig, UnsupportedModelError
    except ImportError as exc:
        return f"tp layout: not checked (the engine is not installed: {exc})"
    try:
        model = ModelConfig.from_dict(raw)
    except (KeyError, TypeError, ValueError, UnsupportedModelError) as exc:
        return (f"tp layout: not checked ({source} is not a DeepSeek-V2/V3 config the engine "
                f"reads: {type(exc).__name__}: {exc})")
    keys = _role_tp_keys(cfg)
    for key, tp in keys:
        try:
            tp_layout(model, tp)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc} ({source})") from None
    sizes = ", ".join(f"{key}={tp}" for key, tp in keys)
    return f"tp layout: {sizes} fit the model ({source})"

"""Load an `orch up` YAML file into a validated :class:`~orchestrator.config.schema.OrchConfig`:
every YAML or validation problem becomes one :class:`ConfigError` whose message names the key
path (``prefill.tp``), what is allowed and what to do; each role's tp is then checked against
the model (:func:`orchestrator.config.layout_check.check_tp_layout`)."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from orchestrator.config.errors import ConfigError, validation_error_message, yaml_error_message
from orchestrator.config.checkpoint import check_max_model_len, model_config_dict
from orchestrator.config.layout_check import check_tp_layout
from orchestrator.config.v4_check import check_v4_staging, is_v4
from orchestrator.config.schema import OrchConfig


def _override(data: dict, key: str, value: object) -> None:
    """Set dotted ``key`` of the YAML mapping ``data`` to ``value`` (sections made as needed;
    a section that is not a mapping is left for validation to report)."""
    *sections, last = key.split(".")
    node = data
    for name in sections:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            return
    node[last] = value


def _resolve_config_json(data: dict, folder: Path) -> None:
    """Make a relative ``model.config_json`` relative to the YAML file's ``folder``."""
    model = data.get("model")
    value = model.get("config_json") if isinstance(model, dict) else None
    if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
        model["config_json"] = str(folder / value)


def load_config(path: str | Path, overrides: dict[str, object] | None = None,
                planning: bool = False) -> OrchConfig:
    """Read and validate a YAML config file, and each role's tp against the model
    (:func:`orchestrator.config.layout_check.check_tp_layout`, when the model's config is at
    hand), ``model.max_model_len`` against its ``max_position_embeddings`` and a DeepSeek-V4
    PD role's ``v4_staging_blocks`` against the longest request.

    ``overrides``: dotted key path -> value (``{"router.port": 9000}``) replacing the file's
    values before validation (the `orch up --port` flags). ``planning``: the config is only
    planned (`orch up --dry-run`, `orch plan`), so a DeepSeek-V4 layout that V4 serving
    refuses still loads (the dry run prints that refusal after the plan).

    Raises:
        ConfigError: the file is missing or unreadable, is not YAML, or does not validate, or
            a tp does not fit the model, or ``max_model_len`` exceeds the model's positions
            (unless ``$ORCH_ALLOW_LONG_MAX_MODEL_LEN``), or a ``v4_staging_blocks`` cannot hold
            one request; the message names each offending key path, what is allowed and
            what to do.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}; check the path "
                          "(examples live in configs/)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_message(path, exc)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, mode, "
                          f"prefill, ...), got {type(data).__name__}; see docs/config.md")
    for key, value in (overrides or {}).items():
        _override(data, key, value)
    _resolve_config_json(data, path.resolve().parent)
    try:
        cfg = OrchConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(validation_error_message(path, exc, OrchConfig)) from None
    try:
        check_tp_layout(cfg)
    except ConfigError as exc:
        if not (planning and serves_v4(cfg)):
            raise ConfigError(f"invalid config {path}:\n- {exc}") from None
    try:
        _check_against_model(cfg)
    except (ConfigError, ValueError) as exc:
        raise ConfigError(f"invalid config {path}:\n- {exc}") from None
    return cfg


def _check_against_model(cfg: OrchConfig) -> None:
    """What the model's config.json bounds, planned or served alike: ``max_model_len`` by
    ``max_position_embeddings``, a DeepSeek-V4 PD role's ``v4_staging_blocks`` by the
    longest request (nothing when config.json is not at hand)."""
    raw, source = model_config_dict(cfg.model)
    if raw is None:
        return
    check_max_model_len(cfg.model, raw, source, is_v4(raw))
    if is_v4(raw):
        check_v4_staging(cfg, raw, source)


def serves_v4(cfg: OrchConfig) -> bool:
    """Whether ``cfg``'s model is a DeepSeek-V4 checkpoint (its config.json says so)."""
    raw, _ = model_config_dict(cfg.model)
    return raw is not None and is_v4(raw)

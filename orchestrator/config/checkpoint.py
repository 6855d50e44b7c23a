"""The served checkpoint as the router sees it: where it is, vocab, EOS, layer count.

The router never loads weights; it reads ``config.json`` (vocab, EOS, layers) and
``tokenizer.json``. ``model.path: tiny`` makes the built-in tiny checkpoint (of
``model.tiny_arch``) on first use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.envs import ORCH_ALLOW_LONG_MAX_MODEL_LEN
from orchestrator.config.errors import ConfigError
from orchestrator.config.sections import ModelSection

DEEPSEEK_V3_LAYERS = 61


@dataclass(frozen=True)
class ModelInfo:
    """What the router needs to know about the model.

    ``name``: the configured model path (or "tiny"); token ids lie in ``[0, vocab_size)``;
    ``eos_token_ids`` end a request unless ``ignore_eos``; ``max_model_len``: limit on
    prompt + max_tokens, tokens; ``num_speculative_tokens``: the deployment's MTP drafts per
    step (``decode.speculative``; 0 off).
    """

    name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    max_model_len: int
    num_speculative_tokens: int = 0


def ensure_checkpoint(model: ModelSection) -> Path:
    """Return the checkpoint folder, making the tiny checkpoint first when it is missing.

    Raises:
        FileNotFoundError: a non-tiny path has no config.json (message says what to do).
        ImportError: ``tiny`` was asked for but the engine's tiny checkpoint writer is absent.
    """
    path = model.checkpoint_dir()
    if (path / "config.json").is_file():
        return path
    if not model.is_tiny:
        raise FileNotFoundError(
            f"model.path {path} has no config.json: point model.path at a HuggingFace "
            "checkpoint folder (config.json, *.safetensors, tokenizer.json) or use `tiny`")
    from orchestrator.tiny_model import init_tiny_main  # lazy: the engine is optional here

    return Path(init_tiny_main(str(path), model.tiny_seed, arch=model.tiny_arch))


def read_model_info(checkpoint_dir: Path, name: str, max_model_len: int) -> ModelInfo:
    """Read vocab size, EOS ids and layer count from ``checkpoint_dir/config.json``.

    Raises:
        FileNotFoundError / KeyError: config.json missing or without ``vocab_size``.
    """
    cfg = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelInfo(name=name, vocab_size=int(cfg["vocab_size"]), eos_token_ids=eos_ids,
                     num_layers=int(cfg.get("num_hidden_layers", DEEPSEEK_V3_LAYERS)),
                     max_model_len=max_model_len)


def model_config_dict(model: ModelSection) -> tuple[dict | None, str]:
    """The served model's ``config.json`` contents, without needing the checkpoint to exist.

    Returns ``(config, where)``: the checkpoint's config.json, else ``model.config_json``'s,
    else the tiny config (``model.path: tiny`` not made yet), else None; and a sentence
    saying where it came from or why it is unknown.
    """
    config = model.checkpoint_dir() / "config.json"
    if not config.is_file() and model.config_json:
        config = Path(model.config_json).expanduser()
        if not config.is_file():
            return None, f"model.config_json {config} not found"
    if config.is_file():
        try:
            return json.loads(config.read_text()), str(config)
        except (OSError, ValueError) as exc:
            return None, f"{config} is not readable JSON ({exc})"
    if not model.is_tiny:
        return None, f"{config} not found"
    try:
        from orchestrator.tiny_model import TINY_ARCHS, tiny_config_dict  # lazy: engine optional
    except ImportError:
        return None, (f"tiny checkpoint not created yet at {config.parent} and the engine is "
                      "not installed; run `orch model init-tiny` then dry-run again")
    if model.tiny_arch == "deepseek_v4":
        from orchestrator.tiny_model_v4 import tiny_v4_config_dict  # noqa: PLC0415

        return tiny_v4_config_dict(), \
            f"the built-in tiny config; not created yet at {config.parent}"
    return tiny_config_dict(**TINY_ARCHS[model.tiny_arch]), \
        f"the built-in tiny config; not created yet at {config.parent}"


def check_max_model_len(model: ModelSection, raw: dict, source: str, v4: bool) -> None:
    """``model.max_model_len`` is at most the model's ``max_position_embeddings`` (``raw``:
    its config.json, from ``source``; nothing checked when it has none), as vLLM's
    ``_get_and_verify_max_len`` holds it unless ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is set:
    positions past it were never trained (with YaRN it is already the extended length).
    ``$ORCH_ALLOW_LONG_MAX_MODEL_LEN`` (engine/envs.py) lets a longer one through, except
    for DeepSeek-V4 (``v4``), whose runner refuses any step past it (engine/v4/runner.py).

    Raises:
        ConfigError: ``max_model_len`` is above ``max_position_embeddings``; the message names
            both numbers and the fix.
        ValueError: ``$ORCH_ALLOW_LONG_MAX_MODEL_LEN`` is not a flag.
    """
    limit = raw.get("max_position_embeddings")
    if limit is None or model.max_model_len <= int(limit):
        return
    if ORCH_ALLOW_LONG_MAX_MODEL_LEN.get() and not v4:
        return
    allow = ("; DeepSeek-V4 serves no position past it" if v4 else
             f", or set {ORCH_ALLOW_LONG_MAX_MODEL_LEN.name}=1 to serve it anyway (positions "
             "past it were never trained: outputs may degrade or turn to NaN)")
    raise ConfigError(f"model.max_model_len ({model.max_model_len}) is above the model's "
                      f"max_position_embeddings ({int(limit)}, {source}): lower "
                      f"model.max_model_len to <= {int(limit)}{allow}")


def layer_count_for_plan(model: ModelSection) -> tuple[int | None, str]:
    """Layers to plan KV transfer for, without needing the checkpoint to exist.

    Returns ``(num_layers or None, a sentence saying where it came from)``.
    """
    raw, source = model_config_dict(model)
    if raw is None:
        return (None, source) if model.is_tiny else \
            (DEEPSEEK_V3_LAYERS, f"{source}: assuming DeepSeek-V3 ({DEEPSEEK_V3_LAYERS} layers)")
    if raw.get("num_hidden_layers") is None:
        return DEEPSEEK_V3_LAYERS, (f"{source} has no num_hidden_layers: assuming DeepSeek-V3 "
                                    f"({DEEPSEEK_V3_LAYERS} layers)")
    return int(raw["num_hidden_layers"]), f"num_hidden_layers from {source}"

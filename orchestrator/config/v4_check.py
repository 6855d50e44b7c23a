"""DeepSeek-V4 serving layouts at config load: what :mod:`engine.v4.runner` serves today
(colocated, one rank per instance, no prefix cache) and a :class:`ConfigError` naming every
key to change otherwise, before anything starts (the rank would refuse the same at load,
:func:`engine.v4.runner.check_v4_serving`)."""

from __future__ import annotations

from orchestrator.config.errors import ConfigError
from orchestrator.config.schema import OrchConfig


def is_v4(raw: dict) -> bool:
    """True when the parsed config.json is DeepSeek-V4 (``model_type`` / ``architectures``)."""
    return raw.get("model_type") == "deepseek_v4" or \
        (raw.get("architectures") or [None])[0] == "DeepseekV4ForCausalLM"


def check_v4_layout(cfg: OrchConfig, source: str) -> str:
    """The tp-layout report line of a V4 model.

    Raises:
        ConfigError: the config asks for what V4 serving does not support yet: PD
            (``mode: disaggregated``), ``decode.tp`` > 1, ``decode.ep``, graph mode, MTP,
            the prefix cache; the message names each key and its fix.
    """
    d = cfg.decode
    bad = []
    if cfg.mode != "colocated":
        bad.append("mode: disaggregated (V4 through PD is not wired yet; set mode: colocated)")
    for on, what in ((d.tp > 1, f"decode.tp={d.tp} (set 1)"), (d.ep, "decode.ep (set false)"),
                     (d.graph.enabled, "decode.graph.enabled (set false)"),
                     (d.num_speculative_tokens > 0, "decode.speculative (remove it; no MTP)"),
                     (d.prefix_cache, "decode.prefix_cache (set false; V4 has no prefix "
                                      "cache)")):
        if on:
            bad.append(what)
    if bad:
        raise ConfigError(f"model is DeepSeek-V4 ({source}), served colocated on one rank per "
                          "instance for now; not supported yet: " + "; ".join(bad)
                          + " (docs/engine.md \"DeepSeek-V4\")")
    return f"tp layout: DeepSeek-V4, decode.tp=1 colocated ({source})"

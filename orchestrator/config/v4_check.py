"""DeepSeek-V4 serving layouts at config load: what :mod:`engine.v4.runner` serves today
(one rank per instance, colocated or PD tp 1 -> tp 1, expert parallelism over a role's DP
ranks, no prefix cache) and a :class:`ConfigError` naming every key to change otherwise,
before anything starts (the rank would refuse the same at load,
:func:`engine.v4.runner.check_v4_serving`, :func:`engine.layout.expert_range`)."""

from __future__ import annotations

from types import SimpleNamespace

from orchestrator.config.errors import ConfigError
from orchestrator.config.schema import OrchConfig


def is_v4(raw: dict) -> bool:
    """True when the parsed config.json is DeepSeek-V4 (``model_type`` / ``architectures``)."""
    return raw.get("model_type") == "deepseek_v4" or \
        (raw.get("architectures") or [None])[0] == "DeepseekV4ForCausalLM"


def check_v4_layout(cfg: OrchConfig, raw: dict, source: str) -> str:
    """The tp-layout report line of a V4 model.

    Colocated: sized by ``decode`` like every colocated config (``prefill`` gives only the
    chunking, ``chunk_size`` / ``max_num_batched_tokens``; its other keys are not read, as in
    configs/colocated.yaml). Disaggregated: both sections are checked.

    Raises:
        ConfigError: the config asks for what V4 serving does not support yet: ``tp`` > 1,
            prefill ``cp`` > 1 or ``layer_sharding``, graph mode, MTP, the prefix cache
            (either role); the message names each key and its fix. Or a role's ``ep`` size
            (its ``dp``) does not divide ``n_routed_experts``.
    """
    d = cfg.decode
    bad = [what for on, what in (
        (d.tp > 1, f"decode.tp={d.tp} (set 1)"),
        (d.graph.enabled, "decode.graph.enabled (set false)"),
        (d.num_speculative_tokens > 0, "decode.speculative (remove it; no MTP)"),
        (d.prefix_cache, "decode.prefix_cache (set false; V4 has no prefix cache)")) if on]
    if cfg.mode == "disaggregated":
        p = cfg.prefill
        bad += [what for on, what in (
            (p.tp > 1, f"prefill.tp={p.tp} (set 1)"),
            (p.cp > 1, f"prefill.cp={p.cp} (set 1)"),
            (bool(p.layer_sharding), "prefill.layer_sharding (remove it)"),
            (p.prefix_cache, "prefill.prefix_cache (set false; V4 has no prefix cache)")) if on]
    if bad:
        raise ConfigError(f"model is DeepSeek-V4 ({source}), served on one rank per instance "
                          "for now (colocated, or PD prefill tp 1 -> decode tp 1; EP over DP "
                          "ranks); not supported yet: " + "; ".join(bad)
                          + " (docs/engine.md \"DeepSeek-V4\")")
    ep = _check_ep(cfg, raw, source)
    if cfg.mode == "disaggregated":
        return (f"tp layout: DeepSeek-V4, prefill.tp=1{ep['prefill']} -> "
                f"decode.tp=1{ep['decode']} disaggregated ({source})")
    return f"tp layout: DeepSeek-V4, decode.tp=1{ep['decode']} colocated ({source})"


def _check_ep(cfg: OrchConfig, raw: dict, source: str) -> dict[str, str]:
    """Per role its report suffix (`` (ep over dp = N)`` or empty); a role's EP size (its
    ``dp``: tp 1) must divide ``n_routed_experts`` (the engine's own check)."""
    out = {}
    for name in ("prefill", "decode"):
        section = getattr(cfg, name)
        on = section.ep and (name == "decode" or cfg.mode == "disaggregated")
        out[name] = f" (ep over dp = {section.dp})" if on else ""
        if not on:
            continue
        try:
            from engine.layout import expert_range  # noqa: PLC0415 (lazy: torch)
        except ImportError:
            continue  # NOTE: the rank checks it at load
        try:
            expert_range(SimpleNamespace(n_routed_experts=raw.get("n_routed_experts")),
                         section.dp, 0)
        except ValueError as exc:
            raise ConfigError(f"{name}.ep: {exc} ({source})") from None
    return out

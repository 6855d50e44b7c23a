"""Does each role's layout (``tp``, and with ``ep`` the expert-parallel size ``dp * tp``) fit
the served model? Checked at config load and by ``orch up --dry-run``, before anything starts.

The check is the engine's own (:func:`engine.layout.tp_layout`, as the ranks run it at load)
on the checkpoint's ``config.json``, or the tiny config when not made yet; with neither (or
one the engine cannot read) nothing is checked here and the report says why.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.checkpoint import model_config_dict
from orchestrator.config.schema import OrchConfig
from orchestrator.config.errors import ConfigError
from orchestrator.config.v4_check import check_v4_layout, is_v4


@dataclass(frozen=True)
class RoleLayout:
    """One role's layout as the config sets it: ``section`` is its key (``prefill``, or
    ``decode`` which also sizes colocated instances)."""

    section: str
    tp: int
    ep_size: int  # dp * tp (* cp) with ep on, else 1

    def describe(self) -> str:
        ep = f" (ep over dp x tp = {self.ep_size})" if self.ep_size > 1 else ""
        return f"{self.section}.tp={self.tp}{ep}"


def _role_layouts(cfg: OrchConfig) -> list[RoleLayout]:
    """The layout of every role that runs: prefill and decode, or only decode in colocated
    mode (colocated instances are sized by the decode section)."""
    sections = [("prefill", cfg.prefill)] if cfg.mode == "disaggregated" else []
    sections.append(("decode", cfg.decode))
    def ranks(name: str) -> int:  # per instance; NOTE: a CP prefill instance has cp ranks
        section = cfg.prefill if name == "prefill" else cfg.decode
        return section.tp * (cfg.prefill.cp if name == "prefill" else 1)

    return [RoleLayout(name, s.tp, s.dp * ranks(name) if s.ep else 1) for name, s in sections]


def check_tp_layout(cfg: OrchConfig) -> str:
    """Check every role's tp (and expert-parallel size) against the model; returns one report
    line saying what was checked against what (or why nothing was).

    Raises:
        ConfigError: a tp does not divide a size the layout splits (attention heads, dense or
            expert intermediate size), or an expert-parallel size does not divide
            ``n_routed_experts``; the message names the key path and the sizes that work. Or
            the checkpoint's ``quantization_config`` is one orch cannot run. Or
            ``prefill.graph`` with a DSA (V3.2, GLM-5) or DeepSeek-V4 model.
    """
    raw, source = model_config_dict(cfg.model)
    if raw is None:
        return f"tp layout: not checked ({source})"
    if is_v4(raw):
        return check_v4_layout(cfg, source, raw)
    try:
        from engine.layout import tp_layout  # lazy: torch
        from engine.model_config import ModelConfig, UnsupportedModelError
        from engine.quant.formats import UnsupportedQuantizationError
    except ImportError as exc:
        return f"tp layout: not checked (the engine is not installed: {exc})"
    try:
        model = ModelConfig.from_dict(raw)
    except UnsupportedQuantizationError as exc:
        # NOTE: every rank would refuse it at load: refused here, before anything starts
        raise ConfigError(f"model.path: {exc} ({source})") from None
    except (KeyError, TypeError, ValueError, UnsupportedModelError) as exc:
        return (f"tp layout: not checked ({source} is not a DeepSeek-V2/V3 config the engine "
                f"reads: {type(exc).__name__}: {exc})")
    if cfg.prefill.graph.enabled and model.uses_sparse_attention:
        # NOTE: every prefill rank would refuse it at start-up (check_prefill_graph)
        raise ConfigError("prefill.graph does not run DSA sparse attention (DeepSeek-V3.2, "
                          f"GLM-5: {source} has index_topk={model.index_topk}): set "
                          "prefill.graph.enabled false")
    layouts = _role_layouts(cfg)
    for role in layouts:
        # NOTE: tp alone first, so an error names the key that has to change
        for key, ep_size in ((f"{role.section}.tp", 1), (f"{role.section}.ep", role.ep_size)):
            try:
                tp_layout(model, role.tp, ep_size)
            except ValueError as exc:
                raise ConfigError(f"{key}: {exc} ({source})") from None
    _check_layer_sharding(cfg, model, source)
    sizes = ", ".join(role.describe() for role in layouts)
    return f"tp layout: {sizes} fit the model ({source})"


def _check_layer_sharding(cfg: OrchConfig, model, source: str) -> None:
    """``prefill.layer_sharding`` names only linears the model has (q_a/q_b_proj need a
    ``q_lora_rank``, q_proj its absence) and, when the checkpoint is at hand, none it keeps
    quantized (every CP rank would refuse it at load)."""
    names = cfg.prefill.layer_sharding
    has = {"q_a_proj": bool(model.q_lora_rank), "q_b_proj": bool(model.q_lora_rank),
           "q_proj": not model.q_lora_rank}
    missing = [n for n in names if not has.get(n, True)]
    if missing:
        raise ConfigError(f"prefill.layer_sharding: the model has no {missing} "
                          f"(q_lora_rank={model.q_lora_rank}); drop them ({source})")
    ckpt = cfg.model.checkpoint_dir()
    if not names or model.quantization is None or not (ckpt / "config.json").is_file():
        return
    from engine.quant.linear import held_quantized  # lazy: torch
    from engine.quant.load import quant_plan

    plan = quant_plan(ckpt, model.quantization, cfg.model.fp8_storage)
    kept = [n for n in names if held_quantized(plan, f"model.layers.0.self_attn.{n}.weight")]
    if kept:
        raise ConfigError(f"prefill.layer_sharding: {kept} are stored quantized "
                          f"({model.quantization.method}) in {ckpt} and only float linears "
                          "are layer-sharded; drop them from prefill.layer_sharding")

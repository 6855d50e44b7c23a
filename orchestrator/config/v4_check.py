"""DeepSeek-V4 serving layouts at config load: what :mod:`engine.v4.runner` serves today
(TP on each role, colocated or PD across any tp, e.g. prefill tp 2 -> decode tp 1; expert
parallelism over a role's dp x tp ranks, as V3's; FP8 block linears and FP4 routed experts
dequantized at load, or kept as stored with ``model.fp8_storage: fp8`` where each TP part is
whole blocks; no CP, decode or prefill graph mode, MTP or prefix cache) and
a :class:`ConfigError` naming every key to change otherwise, before anything starts (the rank
would refuse the same at load, :func:`engine.v4.runner.check_v4_serving`,
:func:`engine.v4.tp.check_tp` and :func:`engine.layout.expert_range`). Also a PD role's
staging pool against the longest request (:func:`check_v4_staging`, planned or served)."""

from __future__ import annotations

from types import SimpleNamespace

from engine.quant.formats import UnsupportedQuantizationError, v4_quant_scheme
from orchestrator.config.errors import ConfigError
from orchestrator.config.schema import OrchConfig

# NOTE: the sizes engine/v4/tp.py splits per rank, with transformers' defaults
_TP_UNITS = {"num_attention_heads": 64, "moe_intermediate_size": 2048, "vocab_size": 129280}


def is_v4(raw: dict) -> bool:
    """True when the parsed config.json is DeepSeek-V4 (``model_type`` / ``architectures``)."""
    return raw.get("model_type") == "deepseek_v4" or \
        (raw.get("architectures") or [None])[0] == "DeepseekV4ForCausalLM"


def _tp_refusal(raw: dict, key: str, tp: int) -> str | None:
    """``key=tp`` and what it does not split (engine/v4/tp.py ``check_tp``: it divides the
    heads, ``moe_intermediate_size`` and the vocabulary, and divides or is a multiple of
    ``o_groups``), or None."""
    sizes = {name: int(raw.get(name, default)) for name, default in _TP_UNITS.items()}
    bad = [f"{name}={n}" for name, n in sizes.items() if n % tp]
    groups = int(raw.get("o_groups", 8))
    if groups % tp and tp % groups:
        bad.append(f"o_groups={groups} (or be a multiple of it)")
    if not bad:
        return None
    return f"{key}={tp} (it must divide {', '.join(bad)})"


def check_v4_layout(cfg: OrchConfig, source: str, raw: dict | None = None) -> str:
    """The tp-layout report line of a V4 model (``raw``: its config.json, for the tp and EP
    sizes).

    Colocated: sized by ``decode`` like every colocated config (``prefill`` gives only the
    chunking, ``chunk_size`` / ``max_num_batched_tokens``; its other keys are not read, as in
    configs/colocated.yaml). Disaggregated: both sections are checked.

    Raises:
        ConfigError: the config asks for what V4 serving does not support yet: prefill
            ``cp`` > 1 or ``layer_sharding``, graph mode (decode or prefill), MTP, the prefix cache (either role),
            or a ``tp`` that does not divide the attention heads, ``o_groups``,
            ``moe_intermediate_size`` or the vocabulary, or a quantization engine/v4 does
            not load (W8A8, an unknown ``expert_dtype``:
            :func:`engine.quant.formats.v4_quant_scheme`)
            or keep (``model.fp8_storage: fp8`` with a role ``tp`` that cuts an FP8 block
            or an MXFP4 scale group: :func:`engine.v4.stored.block_cuts`); the message
            names each key and fix. Or a
            role's EP size (``dp * tp``) does not divide ``n_routed_experts``.
    """
    raw = raw or {}
    d = cfg.decode
    bad = [what for on, what in (
        (d.graph.enabled, "decode.graph.enabled (set false)"),
        (cfg.prefill.graph.enabled, "prefill.graph.enabled (set false)"),
        (d.num_speculative_tokens > 0, "decode.speculative (remove it; no MTP)"),
        (d.prefix_cache, "decode.prefix_cache (set false; V4 has no prefix cache)")) if on]
    tps = [("decode.tp", d.tp)]
    if cfg.mode == "disaggregated":
        p = cfg.prefill
        bad += [what for on, what in (
            (p.cp > 1, f"prefill.cp={p.cp} (set 1)"),
            (bool(p.layer_sharding), "prefill.layer_sharding (remove it)"),
            (p.prefix_cache, "prefill.prefix_cache (set false; V4 has no prefix cache)")) if on]
        tps.insert(0, ("prefill.tp", p.tp))
    refused = [(key, r) for key, tp in tps if (r := _tp_refusal(raw, key, tp))]
    bad += [r for _, r in refused]
    eps = {"prefill.tp": cfg.prefill.ep, "decode.tp": d.ep}
    split = [(key, tp, eps[key]) for key, tp in tps if key not in dict(refused)]
    bad += _quant_refusals(raw, cfg.model.fp8_storage, split)
    if bad:
        raise ConfigError(f"model is DeepSeek-V4 ({source}), served with TP and EP (colocated, "
                          "or PD across any tp); not supported yet: "
                          + "; ".join(bad) + " (docs/engine.md \"DeepSeek-V4\")")
    ep = _check_ep(cfg, raw, source)
    if cfg.mode == "disaggregated":
        return (f"tp layout: DeepSeek-V4, prefill.tp={cfg.prefill.tp}{ep['prefill']} -> "
                f"decode.tp={d.tp}{ep['decode']} disaggregated ({source})")
    return f"tp layout: DeepSeek-V4, decode.tp={d.tp}{ep['decode']} colocated ({source})"


def check_v4_staging(cfg: OrchConfig, raw: dict, source: str) -> None:
    """A PD role's ``v4_staging_blocks`` (when set) holds one request of any prompt length up
    to ``model.max_model_len``: at least the most staging blocks any such prompt takes
    (:func:`engine.v4.staging.most_staging_blocks`; not monotonic in the prompt length, so not
    the longest prompt's). Unset, the pool is ``num_kv_blocks``, which the schema already holds
    to ``max_model_len`` tokens (``staged_rows(n) <= n``). Colocated roles do not read it.

    Raises:
        ConfigError: a role's ``v4_staging_blocks`` is below that; the message names the key,
            the value needed and a prompt length needing it.
    """
    sides = [(name, getattr(cfg, name).v4_staging_blocks) for name in ("prefill", "decode")]
    sides = [(name, blocks) for name, blocks in sides if blocks is not None]
    if cfg.mode != "disaggregated" or not sides:
        return
    try:
        from engine.v4.config import V4Config  # noqa: PLC0415 (lazy: torch)
        from engine.v4.staging import most_staging_blocks  # noqa: PLC0415
    except ImportError:
        return  # NOTE: the rank refuses such a request at once (rank/leader.py too_big)
    block, max_len = cfg.kv_transfer.block_size, cfg.model.max_model_len
    need, tokens = most_staging_blocks(V4Config.from_dict(raw), max_len, block)
    bad = [f"{name}.v4_staging_blocks ({blocks}) is below {need}" for name, blocks in sides
           if blocks < need]
    if bad:
        raise ConfigError(
            f"{'; '.join(bad)}: a DeepSeek-V4 prompt of {tokens} tokens takes {need} staging "
            f"blocks of kv_transfer.block_size {block} (the most of any prompt up to "
            f"model.max_model_len {max_len}; a longer prompt can take fewer), so it could "
            f"never be served: raise each to >= {need} (or leave it unset: num_kv_blocks) "
            f"({source}; docs/kv_transfer.md \"Staging pool\")")


def _quant_refusals(raw: dict, fp8_storage: str,
                    roles: list[tuple[str, int, bool]]) -> list[str]:
    """What of config.json's quantization engine/v4 cannot serve (:func:`load_v4`'s rule):
    a non-FP8 method or an unknown ``expert_dtype``; with ``fp8_storage: fp8``, per role
    ``(tp key, tp, ep)`` a tp whose split cuts a quantization block (the rank would refuse
    the same at load, :mod:`engine.v4.stored`)."""
    try:
        scheme = v4_quant_scheme(raw)
    except UnsupportedQuantizationError as e:
        return [f"model: {e}"]
    if scheme is None or fp8_storage != "fp8":
        return []
    try:
        from engine.v4.config import V4Config  # noqa: PLC0415 (lazy: torch)
        from engine.v4.stored import FP4, FP8, block_cuts  # noqa: PLC0415
    except ImportError:
        return []  # NOTE: the rank checks it at load
    qc = raw.get("quantization_config") or {}
    kind = raw.get("expert_dtype") or qc.get("expert_dtype")
    experts = FP4 if scheme.expert_fp4 else None if kind in ("bf16", "bfloat16") else FP8
    config, bad = V4Config.from_dict(raw), []
    for key, tp, ep in roles:
        cuts = block_cuts(config, tp, ep, scheme, experts)
        if cuts:
            more = f" (and {len(cuts) - 1} more)" if len(cuts) > 1 else ""
            bad.append(f"{key}={tp} with model.fp8_storage=fp8: its split cuts quantization "
                       f"blocks, {cuts[0]}{more} (set model.fp8_storage: dequantize, or a "
                       f"{key} whose parts are whole blocks)")
    return bad


def _check_ep(cfg: OrchConfig, raw: dict, source: str) -> dict[str, str]:
    """Per role its report suffix (`` (ep over dp x tp = N)`` or empty, as V3's); a role's EP
    size (``dp * tp``: every rank of the role, V3's rule) must divide ``n_routed_experts``
    (the engine's own check)."""
    out = {}
    for name in ("prefill", "decode"):
        section = getattr(cfg, name)
        on = section.ep and (name == "decode" or cfg.mode == "disaggregated")
        size = section.dp * section.tp
        out[name] = f" (ep over dp x tp = {size})" if on else ""
        if not on:
            continue
        try:
            from engine.layout import expert_range  # noqa: PLC0415 (lazy: torch)
        except ImportError:
            continue  # NOTE: the rank checks it at load
        try:
            expert_range(SimpleNamespace(n_routed_experts=raw.get("n_routed_experts")), size, 0)
        except ValueError as exc:
            raise ConfigError(f"{name}.ep: {exc} ({source})") from None
    return out

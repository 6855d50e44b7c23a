"""Where instances and ranks go: placement-group bundles, and the `orch up --dry-run` report.

One Ray placement group per instance, strategy STRICT_PACK (a TP group stays on one node),
one bundle per rank: ``{"CPU": c}`` on cpu, ``{"GPU": a, "CPU": c}`` on cuda,
``{"NPU": a, "CPU": c}`` on npu (NPU is a custom Ray resource the node must advertise);
``c`` = ``cluster.cpus_per_rank``, ``a`` = ``cluster.accelerators_per_rank`` (1: a device
per rank; 0.5: two ranks share one, e.g. prefill and decode on one development GPU).
"""

from __future__ import annotations

from rank.config import InstanceConfig
from orchestrator.config.checkpoint import layer_count_for_plan, model_config_dict
from orchestrator.config.errors import ConfigError
from orchestrator.config.v4_check import is_v4
from orchestrator.config.schema import OrchConfig
from orchestrator.config.sections import ClusterSection
from orchestrator.config.layout_check import check_tp_layout
from orchestrator.config.memory_check import describe_memory

STRATEGY = "STRICT_PACK"
_ACCELERATOR = {"cuda": "GPU", "npu": "NPU"}


def rank_bundle(device: str, res: ClusterSection,
                extra: dict[str, float] | None = None) -> dict[str, float]:
    """Resources of one rank (one bundle of its instance's placement group): ``res``'s CPUs
    and accelerator share per rank; ``extra``: the role's ``ray_resources`` (custom node
    labels)."""
    bundle: dict[str, float] = {"CPU": res.cpus_per_rank, **(extra or {})}
    if device in _ACCELERATOR:
        bundle[_ACCELERATOR[device]] = res.accelerators_per_rank
    return bundle


def role_resources(cfg: OrchConfig, role: str) -> dict[str, float]:
    """The configured extra Ray resources of ``role`` (colocated uses the decode section)."""
    return dict((cfg.prefill if role == "prefill" else cfg.decode).ray_resources)


def describe_placement(cfg: OrchConfig, instances: list[InstanceConfig]) -> list[str]:
    """Report lines: each instance, its ranks and their resources, and the totals."""
    lines = [f"mode: {cfg.mode}; device: {instances[0].parallel.device}; dist backend: "
             f"{instances[0].parallel.dist_backend}; ray: "
             f"{cfg.cluster.address or 'embedded local (started by orch up)'}"]
    totals: dict[str, float] = {}
    for inst in instances:
        tp, ranks = inst.parallel.tp, inst.parallel.ranks
        bundle = rank_bundle(inst.parallel.device, cfg.cluster, role_resources(cfg, inst.role))
        cp = f", cp={inst.parallel.cp}" if inst.parallel.cp > 1 else ""
        lines.append(f"{inst.name}: tp={tp}{cp}, placement group {STRATEGY} with {ranks} "
                     f"bundle(s) of {bundle}, kv blocks {inst.scheduler.num_kv_blocks} x "
                     f"{inst.scheduler.block_size} tokens")
        last = ("" if ranks == 1 else ", rank1" if ranks == 2 else
                f", rank1..rank{ranks - 1}")
        lines.append(f"  ranks: rank0 (leader){last}; one Ray actor per rank, bundle index = rank")
        for key, amount in bundle.items():
            totals[key] = totals.get(key, 0) + amount * ranks
    lines.append(f"total: {len(instances)} instance(s), "
                 f"{sum(i.parallel.ranks for i in instances)} rank(s), resources {totals}")
    return lines


def describe_transfer_plans(cfg: OrchConfig, instances: list[InstanceConfig]) -> list[str]:
    """Report lines: the MLA transfer plan of every (prefill, decode) instance pair."""
    if cfg.mode != "disaggregated":
        return ["transfer plan: none (colocated mode moves no KV)"]
    num_layers, source = layer_count_for_plan(cfg.model)
    lines = [f"layers: {num_layers if num_layers is not None else 'unknown'} ({source})"]
    if num_layers is None:
        return lines
    try:
        from kv_transfer.plan import build_transfer_plan  # lazy: data-plane package
    except ImportError as exc:
        return lines + [f"transfer plan: unavailable ({exc}); install the kv_transfer package"]
    prefill = [i for i in instances if i.role == "prefill"]
    decode = [i for i in instances if i.role == "decode"]
    cp = cfg.prefill.cp
    plan = build_transfer_plan(cfg.prefill.tp, cfg.decode.tp, num_layers, kind="mla",
                               prefill_cp=cp)
    pairs = [f"{p.name}->{d.name}" for p in prefill for d in decode]
    # NOTE: the plan is a pure function of (tp/cp sizes, layers, kind): every instance pair of
    # this config uses the same one, so it is printed once with the pairs it applies to.
    shape = f"P{cfg.prefill.tp}" + (f" cp{cp}" if cp > 1 else "")
    lines.append(f"transfer plan {shape} -> D{cfg.decode.tp} (MLA), used by "
                 f"{len(pairs)} instance pair(s): {', '.join(pairs)}")
    for pair in plan.pairs:
        layers = list(pair.layers)
        tokens = f", chunk pieces {pair.cp_rank} and {2 * cp - 1 - pair.cp_rank} of {2 * cp}" \
            if cp > 1 else ""
        lines.append(f"  prefill rank {pair.prefill_rank} -> decode rank {pair.decode_rank}: "
                     f"{len(layers)} layer(s) {_ranges(layers)}{tokens}")
    return lines


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    if not values:
        return "-"
    values = sorted(values)
    parts, start, prev = [], values[0], values[0]
    for v in values[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(parts)


def dry_run_report(cfg: OrchConfig) -> str:
    """The full `orch up --dry-run` text (needs neither Ray nor the checkpoint), the memory
    plan's table included (its fit is :func:`orchestrator.config.memory_check.check_memory`'s).

    Raises:
        ConfigError: a tp does not fit the model (see :func:`check_tp_layout`), or ep is on
            and dp x tp does not divide the routed experts.
    """
    instances = cfg.instances()
    lines = [f"model: {cfg.model.path} -> {cfg.model.checkpoint_dir()} ({cfg.model.dtype}, "
             f"max_model_len {cfg.model.max_model_len})"]
    lines += describe_placement(cfg, instances)
    lines.append(_tp_line(cfg))
    lines += describe_memory(cfg)
    lines += describe_transfer_plans(cfg, instances)
    lines.append(_describe_router(cfg))
    return "\n".join(lines)


def _tp_line(cfg: OrchConfig) -> str:
    """:func:`check_tp_layout`'s line; for a DeepSeek-V4 layout V4 serving refuses, a line
    saying so, so the dry run still plans it (``orch up --dry-run`` prints the refusal after
    the plan: :func:`v4_refusal`)."""
    try:
        return check_tp_layout(cfg)
    except ConfigError:
        if v4_refusal(cfg) is None:
            raise
        return ("tp layout: DeepSeek-V4 serving refuses this layout today (the reason "
                "follows the plan); planned as written")


def v4_refusal(cfg: OrchConfig) -> ConfigError | None:
    """The error V4 serving refuses ``cfg`` with (orchestrator/config/v4_check.py), or None
    (not V4, or a layout it serves)."""
    raw, _ = model_config_dict(cfg.model)
    if raw is None or not is_v4(raw):
        return None
    try:
        check_tp_layout(cfg)
    except ConfigError as exc:
        return exc
    return None


def _describe_router(cfg: OrchConfig) -> str:
    """One line: where the router listens, with what policy, limits and protection."""
    r = cfg.router
    auth = "no token" if r.auth is None else \
        f"token from {r.auth.token_file or '$' + r.auth.token_env}"
    tls = "TLS" if r.tls is not None else "no TLS"
    return (f"router: {r.host}:{r.port} ({tls}, {auth}), policy {r.policy}, max_pending "
            f"{r.max_pending}, request_timeout_s {r.request_timeout_s}"
            + (f", OpenAI HTTP on {r.host}:{r.http_port}" if r.http_port else "")
            + (f", metrics on {r.metrics_host}:{r.metrics_port}/metrics"
               if r.metrics_port else ""))

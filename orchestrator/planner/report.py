"""The plan of an :class:`OrchConfig` for a workload, and its printed table.

Memory and KV capacity come from the memory plan (:mod:`orchestrator.config.memory_check`); seconds
from :mod:`.cost` (the KV transfer: :mod:`.comm_terms`); the operating point from :mod:`.load`.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_groups import kv_groups, reservation
from engine.v4.config import V4Config
from engine.v4.kv_spec import layer_specs
from orchestrator.config.schema import OrchConfig
from orchestrator.config.errors import ConfigError
from orchestrator.config.memory_check import MemoryPlan, build_memory_plan
from orchestrator.config.memory_plan import RolePlan
from orchestrator.config.memory_plan_v4 import pool_plan
from orchestrator.planner.comm_terms import kv_transfer_cost
from orchestrator.planner.cost import decode_step_cost, prefill_cost
from orchestrator.planner.hardware import Hardware
from orchestrator.planner.host_terms import request_calls, router_call_us
from orchestrator.planner.terms import Cost, counts_for
from orchestrator.planner.explain import cost_lines
from orchestrator.planner.load import OperatingPoint, Roles, WorkloadSpec, operating_point
from orchestrator.planner.kv_tail import kv_tail_s, staged_tail_s, v4_chunk_shares
from orchestrator.planner.prefix_hits import cached_tokens
from orchestrator.planner.specs import DeviceSpec, default_device, named_device


@dataclass(frozen=True)
class Plan:
    """Everything ``orch plan`` prints.

    Attributes:
        prefill, decode: the role plans (the same colocated plan twice in colocated mode).
        slots: requests one decode DP rank holds (KV blocks and max_num_seqs;
            DeepSeek-V4: its group pools, :func:`requests_held`).
        prefill_cost: one request on one prefill DP rank.
        step_cost: one decode step at the operating point's batch.
        transfer: the KV of one request to decode (None colocated).
        best_split: (prefill dp, decode dp, output tok/s) of the best split of the same ranks.
        kv_tail_s: the part of ``transfer`` left after the prefill forward (layer by layer
            or after each chunk's forward, ``kv_transfer.layerwise``; DeepSeek-V4: after
            each chunk's step; :mod:`orchestrator.planner.kv_tail`): what the second token
            waits for.
        cached, shipped: prompt tokens a request finds in prefill's prefix cache (not
            computed) and the prompt tokens whose KV it ships (decode holds the rest;
            colocated: 0) at the workload's hit rate.
    """

    cfg: OrchConfig
    memory: MemoryPlan
    device: DeviceSpec
    workload: WorkloadSpec
    prefill: RolePlan
    decode: RolePlan
    slots: int
    prefill_cost: Cost
    step_cost: Cost
    transfer: Cost | None
    point: OperatingPoint
    best_split: tuple[int, int, float] | None
    kv_tail_s: float = 0.0
    cached: int = 0
    shipped: int = 0


def resolve_device(cfg: OrchConfig, key: str | None, recalibrate: bool = False) -> DeviceSpec:
    """``key`` from devices.yaml (or "cpu": measured), else the config's platform default.

    Raises:
        ValueError: unknown key or platform.
    """
    platform = cfg.platform().device_type
    key = key or ("cpu" if platform == "cpu" else default_device(platform).key)
    if key == "cpu":
        from orchestrator.planner.calibrate import cpu_device

        return cpu_device(recalibrate)
    return named_device(key)


def requests_held(plan: RolePlan, tokens: int, model=None) -> int:
    """Requests of ``tokens`` tokens one DP rank holds: KV blocks and max_num_seqs (a
    DeepSeek-V4 ``model``: the fewest over its group pools of blocks // what one request
    commits there, engine/pool_plan.py and engine/v4/admission.py)."""
    lay = plan.layout
    if isinstance(model, V4Config):
        pools = pool_plan(model, lay)
        need = reservation(kv_groups(layer_specs(model)), pools.block_sizes, tokens,
                           lay.chunk_size)
        return min(lay.max_num_seqs, *(pools.blocks[g] // n for g, n in need.items()))
    return min(lay.max_num_seqs, lay.num_kv_blocks // -(-tokens // lay.block_size))


def plan_config(cfg: OrchConfig, wl: WorkloadSpec, device: DeviceSpec) -> Plan:
    """Predict ``cfg`` serving ``wl`` on ``device``.

    Raises:
        ConfigError: no config.json to plan from, a rank (on cpu: all ranks together) needs
            more memory than ``device`` has, or a request is longer than
            model.max_model_len (the router refuses it) or does not fit one DP rank's KV.
    """
    if wl.input_len + wl.output_len > cfg.model.max_model_len:
        raise ConfigError(f"one request of {wl.input_len}+{wl.output_len} tokens is longer "
                          f"than model.max_model_len ({cfg.model.max_model_len}): the router "
                          "refuses it; raise max_model_len or shorten the workload")
    memory, source = build_memory_plan(cfg)
    if memory is None:
        raise ConfigError(f"cannot plan: {source}")
    _check_fits(memory, device)
    roles = {p.layout.role: p for p in memory.roles}
    colocated = "colocated" in roles
    pre, dec = (roles["colocated"],) * 2 if colocated else (roles["prefill"], roles["decode"])
    slots = requests_held(dec, wl.input_len + wl.output_len, memory.model)
    if slots < 1 or requests_held(pre, wl.input_len, memory.model) < 1:
        raise ConfigError(f"one request of {wl.input_len}+{wl.output_len} tokens does not fit "
                          "a DP rank's KV cache: raise num_kv_blocks or shorten the workload")
    hw, opts = Hardware(device), wl.options
    m, prec = memory.model, memory.precision
    cached = cached_tokens(wl.input_len, wl.hit, pre.layout.block_size)
    shipped = 0 if colocated else \
        wl.input_len - cached_tokens(wl.input_len, wl.hit, dec.layout.block_size)
    p_cost = prefill_cost(m, pre, prec, hw, wl.input_len, cfg.prefill.chunk_size, opts,
                          cached)
    context = wl.input_len + wl.output_len / 2
    transfer = None if colocated else kv_transfer_cost(
        m, prec, hw, shipped, pre.layout.ranks + dec.layout.ranks)
    first = device.first_token_us if colocated else device.pd_first_token_us
    calls = (request_calls(colocated) * router_call_us(device, cfg.router.leader_calls)
             + first) * 1e-6
    def per_token_s(batch: float) -> float:
        step = decode_step_cost(m, dec, prec, hw, batch, context, opts)
        return step.total_s / step.tokens_per_step

    tail = 0.0 if transfer is None else _kv_tail(cfg, m, transfer.total_s, p_cost.total_s,
                                                 wl.input_len - cached)
    shape = Roles(p_cost.total_s, calls, per_token_s,
                  pre.layout.dp, dec.layout.dp, slots, colocated, tail)
    point = operating_point(shape, wl)
    step = decode_step_cost(m, dec, prec, hw, point.decode_batch, context, opts)
    best = None if colocated else _best_split(shape, pre, dec, wl)
    return Plan(cfg, memory, device, wl, pre, dec, slots, p_cost, step, transfer, point,
                best, tail, cached, shipped)


def _kv_tail(cfg: OrchConfig, m, transfer_s: float, prefill_s: float, computed: int) -> float:
    """:func:`~orchestrator.planner.kv_tail.kv_tail_s` of a prompt whose ``computed`` tokens
    prefill runs in ``prefill.chunk_size`` chunks: layer by layer or after each chunk's
    forward (``kv_transfer.layerwise``); DeepSeek-V4 after each chunk's step, whatever that
    key says, each chunk its own rows' bytes (:func:`~orchestrator.planner.kv_tail.
    v4_chunk_shares`)."""
    chunk = cfg.prefill.chunk_size
    if isinstance(m, V4Config):
        return staged_tail_s(transfer_s, prefill_s, v4_chunk_shares(m, computed, chunk))
    return kv_tail_s(transfer_s, prefill_s, -(-computed // chunk), m.num_hidden_layers,
                     cfg.kv_transfer.layerwise)


def _send_timing(cfg: OrchConfig, v4: bool) -> str:
    """When the KV of a chunk leaves prefill, as ``orch plan`` prints it."""
    if v4:
        return "after each chunk's step"
    return "layer by layer" if cfg.kv_transfer.layerwise else "after each chunk"


def _best_split(r: Roles, pre: RolePlan, dec: RolePlan,
                wl: WorkloadSpec) -> tuple[int, int, float]:
    """The prefill:decode DP split of the same ranks with the most output tokens/s at
    capacity (per-rank costs held fixed: the EP share of experts changes with it)."""
    tp_p, tp_d = pre.layout.tp * pre.layout.cp, dec.layout.tp
    ranks = pre.layout.ranks + dec.layout.ranks
    per_decode = r.slots / (wl.output_len * r.step_s(r.slots))
    best = (0, 0, 0.0)
    for dp_p in range(1, ranks // tp_p + 1):
        dp_d = (ranks - dp_p * tp_p) // tp_d
        if dp_d >= 1:
            rate = min(dp_p / r.prefill_s, dp_d * per_decode)
            if rate * wl.output_len > best[2]:
                best = (dp_p, dp_d, rate * wl.output_len)
    return best


def _check_fits(memory: MemoryPlan, device: DeviceSpec) -> None:
    """Raises ConfigError when the layout's memory plan does not fit ``device`` (cpu: one
    machine's RAM shared by every rank; an accelerator: one rank's memory)."""
    if device.platform == "cpu":
        need, who = memory.all_ranks_bytes, "all ranks together need"
    else:
        need, who = max(p.total_bytes for p in memory.roles), "one rank needs"
    if need > device.memory_gb * 1e9:
        raise ConfigError(f"the layout does not fit {device.name}: {who} {_gb(need)} GB of "
                          f"{device.memory_gb:.4g} GB; pick a device with more memory "
                          "(--device) or change the layout (`orch up --dry-run CONFIG` shows "
                          "its memory plan)")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _cost(c: Cost, scale: float, unit: str) -> str:
    return (f"{c.total_s * scale:.3g} {unit} (compute {c.compute_s * scale:.3g}, memory "
            f"{c.memory_s * scale:.3g}, collectives {c.comm_s * scale:.3g}, host "
            f"{c.overhead_s * scale:.3g}{', overlapped' if c.overlap else ''})")


def _role_line(name: str, plan: RolePlan, device: DeviceSpec, held: int, tokens: int,
               v4: bool = False) -> str:
    lay = plan.layout
    ep = f", ep (EP {lay.ep_size})" if lay.ep else ""
    cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
    blocks = -(-tokens // lay.block_size)
    kv = "DeepSeek-V4 group pools" if v4 else \
        f"{lay.num_kv_blocks} KV blocks / {blocks} per request"
    return (f"{name}: dp {lay.dp} x tp {lay.tp}{cp}{ep}: one rank {_gb(plan.total_bytes)} GB "
            f"(weights {_gb(plan.bytes_of('weights'))}, KV {_gb(plan.bytes_of('kv'))}, "
            f"workspace {_gb(plan.bytes_of('workspace'))}) of {device.memory_gb:.4g} GB; "
            f"{held} request(s) per DP rank ({kv}, max_num_seqs {lay.max_num_seqs})")


def _options_text(plan: Plan) -> str:
    o = plan.workload.options
    mtp = f"; prefix-cache hit {plan.workload.hit:.3g}" if plan.workload.hit else ""
    mtp += f"; MTP {o.mtp} draft(s) at accept {o.accept:g}" if o.mtp else ""
    if not (plan.prefill.layout.ep or plan.decode.layout.ep):
        return mtp
    return f"{mtp}; EPLB {f'on (drift {o.drift:g})' if o.eplb else f'off (skew {o.skew:g})'}"


def format_plan(plan: Plan, explain: bool = False) -> list[str]:
    """The ``orch plan`` report lines (``explain``: every term of a prefill and a step)."""
    wl, pt = plan.workload, plan.point
    load = f"rate {wl.rate:g} req/s" if wl.rate else f"concurrency {pt.concurrency:g}" + (
        ", starting together" if wl.together else "")
    lines = [f"plan on {plan.device.key} ({plan.device.name}); workload in={wl.input_len}, "
             f"out={wl.output_len}, {load}{_options_text(plan)}"]
    colocated = plan.transfer is None
    v4 = isinstance(plan.memory.model, V4Config)
    lines.append(_role_line("colocated" if colocated else "prefill", plan.prefill, plan.device,
                            requests_held(plan.prefill, wl.input_len, plan.memory.model),
                            wl.input_len, v4))
    lines.append(f"  prefill per request: {_cost(plan.prefill_cost, 1, 's')}")
    if not colocated:
        lines.append(_role_line("decode", plan.decode, plan.device, plan.slots,
                                wl.input_len + wl.output_len, v4))
    if explain:
        lines += _hit_lines(plan) + cost_lines(plan.prefill_cost, 1, "s", "    ")
    lines.append(f"  decode step at batch {pt.decode_batch:.3g} per DP rank: "
                 f"{_cost(plan.step_cost, 1e3, 'ms')}")
    if explain:
        lines += cost_lines(plan.step_cost, 1e3, "ms", "    ")
    if plan.transfer is not None:
        nbytes = counts_for(plan.memory.model).kv_bytes_per_request(
            plan.memory.model, plan.memory.precision, plan.shipped)
        lines.append(f"kv transfer per request: {plan.transfer.total_s:.3g} s "
                     f"({_gb(nbytes)} GB); {plan.kv_tail_s:.3g} s of it after the prefill "
                     f"forward ({_send_timing(plan.cfg, v4)})")
    lines.append(predicted_line(pt))
    if plan.best_split is not None:
        dp_p, dp_d, tok_s = plan.best_split
        lines.append(f"best P:D on the same ranks: prefill dp {dp_p} : decode dp {dp_d} -> "
                     f"{tok_s:.4g} output tok/s at capacity")
    return lines


def _hit_lines(plan: Plan) -> list[str]:
    """``--explain``'s prefix-cache term: what the hit rate leaves to compute and ship."""
    wl = plan.workload
    if not wl.hit:
        return []
    block = plan.prefill.layout.block_size
    ship = "" if plan.transfer is None else \
        f"; KV transfer ships {plan.shipped} (decode holds the rest)"
    return [f"    prefix cache: hit {wl.hit:.3g} of {wl.input_len} prompt tokens -> "
            f"{plan.cached} cached ({block}-token blocks, the last token always computed); "
            f"prefill computes {wl.input_len - plan.cached}, attending over the cached "
            f"prefix too{ship}"]


def predicted_line(pt: OperatingPoint) -> str:
    """``predicted: TTFT .., TPOT .., .. output tok/s (..)``."""
    return (f"predicted: TTFT {pt.ttft_s:.3g} s, TPOT {pt.tpot_s * 1e3:.3g} ms, "
            f"{pt.output_tok_s:.4g} output tok/s ({pt.requests_s:.3g} req/s, "
            f"{pt.concurrency:.3g} in flight, decode batch {pt.decode_batch:.3g}; bound: "
            f"{pt.bound})")


def dry_run_lines(cfg: OrchConfig) -> list[str]:
    """The planner's figures for ``orch up --dry-run`` of an accelerator layout (none on cpu,
    whose figures need a calibration run): seed 004's request shape (64K in, 3K out) fitted
    to ``max_model_len``, closed loop filling the decode slots, the platform's default
    device."""
    platform = cfg.platform().device_type
    if platform == "cpu":
        return []
    out = min(3072, cfg.model.max_model_len // 16)
    wl = WorkloadSpec(min(65536, cfg.model.max_model_len - out), out)
    try:
        device = default_device(platform)
        plan = plan_config(cfg, wl, device)
    except (ConfigError, ValueError) as exc:
        return [f"planner: not computed ({exc})"]
    return [f"planner on {device.key}, in={wl.input_len} out={wl.output_len} (`orch plan "
            f"CONFIG --workload ...` for the breakdown): prefill {plan.prefill_cost.total_s:.3g}"
            f" s per request, decode step {plan.step_cost.total_s * 1e3:.3g} ms",
            "  " + predicted_line(plan.point)]

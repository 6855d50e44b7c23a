"""Does the layout fit the devices? The memory plan of an :class:`OrchConfig`, its table for
``orch up --dry-run``, and the check ``orch up`` runs before anything starts.

Each role's rank is planned by :func:`orchestrator.config.memory_plan.plan_role` from the
model's config.json (checkpoint's, else ``model.config_json``, else the tiny config) and
checked against :func:`orchestrator.config.devices.device_memory`: per rank on npu/cuda, all
ranks together on cpu. Without a config.json nothing is checked (the report says why); one
the engine refuses is an error before anything starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from engine.model_config import CheckpointError, ModelConfig, UnsupportedModelError
from engine.v4.config import V4Config
from engine.quant.memory import bytes_per_param
from kv_transfer.backend import COMM_SETTINGS
from kv_transfer.plan import build_transfer_plan
from orchestrator.config.checkpoint import model_config_dict
from orchestrator.config.v4_check import is_v4
from orchestrator.config.schema import OrchConfig
from orchestrator.config.errors import ConfigError
from orchestrator.config.devices import GB, DeviceMemory, device_memory
from orchestrator.config.memory_plan import DTYPE_BYTES, Precision, RolePlan, plan_role
from orchestrator.config.role_layout import RoleLayout
from orchestrator.config.memory_plan_v4 import (V4Precision, plan_role_v4, pools_line,
                                                request_line)


class MemoryPlanError(ConfigError):
    """The layout does not fit the device memory; the message says by how much and what to
    change."""


class UnservableModelError(ConfigError):
    """The model's config.json is one the engine refuses (every rank would fail loading it);
    the message names the file and what is wrong."""


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of every role of a config, and the memory it is checked against.

    Attributes:
        model: the parsed config.json (DeepSeek-V4: :class:`engine.v4.config.V4Config`).
        plan_fn: plans one role of ``model`` (:func:`plan_role` / :func:`plan_role_v4`).
    """

    model: ModelConfig | V4Config
    source: str
    precision: Precision
    roles: tuple[RolePlan, ...]
    memory: DeviceMemory
    plan_fn: Callable[..., RolePlan] = plan_role

    @property
    def all_ranks_bytes(self) -> int:
        """Bytes of every rank of every role together (what a shared cpu machine holds)."""
        return sum(p.total_bytes * p.layout.ranks for p in self.roles)


def role_layouts(cfg: OrchConfig) -> list[RoleLayout]:
    """The :class:`RoleLayout` of each role that runs (colocated: sized by ``decode``)."""
    layouts: dict[str, RoleLayout] = {}
    for inst in cfg.instances():
        if inst.role in layouts:
            continue
        section = cfg.prefill if inst.role == "prefill" else cfg.decode
        s = inst.scheduler
        layouts[inst.role] = RoleLayout(
            role=inst.role, dp=section.dp, tp=inst.parallel.tp, ep=section.ep,
            cp=inst.parallel.cp, layer_sharding=inst.parallel.layer_sharding,
            num_kv_blocks=s.num_kv_blocks, block_size=s.block_size,
            step_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            max_model_len=cfg.model.max_model_len, mtp=s.num_speculative_tokens > 0,
            staging_blocks=0 if inst.role == "colocated" else
            (s.staging_blocks or s.num_kv_blocks), chunk_size=s.chunk_size)
    return list(layouts.values())


def comm_buffer_bytes(cfg: OrchConfig) -> tuple[int, int]:
    """Device bytes (one pair group, one TP / EP / CP communicator) hold: the dist backend's
    :data:`kv_transfer.backend.COMM_SETTINGS`; ``kv_transfer.comm_buffer_mb`` (MB = 10^6)
    overrides the second (HCCL: 2 x ``HCCL_BUFFSIZE``)."""
    settings = COMM_SETTINGS[cfg.platform().dist_backend]
    mb = cfg.kv_transfer.comm_buffer_mb
    return settings.pair_buffer_bytes, \
        settings.buffer_bytes if mb is None else round(mb * 1e6)


def with_communicators(cfg: OrchConfig, model: ModelConfig,
                       layouts: list[RoleLayout]) -> list[RoleLayout]:
    """``layouts`` with their KV pair groups and communicator buffer size set: a prefill rank
    pairs with ``len(sends_from(p))`` ranks of each decode instance, a decode rank with
    ``len(recvs_to(d))`` of each prefill instance (the most over the role's ranks;
    :func:`kv_transfer.build_transfer_plan`); colocated ranks have none."""
    pair_buffer, buffer = comm_buffer_bytes(cfg)
    by_role = {lay.role: lay for lay in layouts}
    pairs: dict[str, int] = {}
    if "prefill" in by_role and "decode" in by_role:
        pre, dec = by_role["prefill"], by_role["decode"]
        plan = build_transfer_plan(pre.tp, dec.tp, model.num_hidden_layers, prefill_cp=pre.cp)
        pairs["prefill"] = dec.dp * max(len(plan.sends_from(p)) for p in range(pre.tp * pre.cp))
        pairs["decode"] = pre.dp * max(len(plan.recvs_to(d)) for d in range(dec.tp))
    return [replace(lay, pair_groups=pairs.get(lay.role, 0), pair_buffer_bytes=pair_buffer,
                    comm_buffer_bytes=buffer) for lay in layouts]


def build_memory_plan(cfg: OrchConfig) -> tuple[MemoryPlan | None, str]:
    """(the plan, or None with the reason why it could not be made; the config.json used).

    Raises:
        UnservableModelError: the engine refuses the config.json (an unsupported
            architecture such as GLM-5, an invalid V3.2 indexer, a missing field), so
            ``orch up`` stops before starting Ray and rank processes that would all fail.
        ConfigError: the device has no memory figure (names the key to set).
    """
    raw, source = model_config_dict(cfg.model)
    if raw is None:
        return None, source
    if is_v4(raw):
        return _v4_memory_plan(cfg, raw, source), source
    try:
        model = ModelConfig.from_dict(raw)
    except UnsupportedModelError as exc:
        raise UnservableModelError(f"{source}: {exc}") from None
    except KeyError as exc:
        raise UnservableModelError(f"{source} has no field {exc}: it is not a DeepSeek-V2/V3/"
                                   "V3.2 config.json the engine reads") from None
    except (TypeError, ValueError) as exc:
        raise UnservableModelError(f"{source} has a field of the wrong type ({exc}): fix it "
                                   "(DeepSeek's config.json is the reference)") from None
    precision = Precision.of(cfg.model.dtype, bytes_per_param(
        model.quantization, DTYPE_BYTES[cfg.model.dtype], cfg.model.fp8_storage))
    roles, memory = _plan_roles(cfg, model, plan_role, precision)
    return MemoryPlan(model, source, precision, roles, memory), source


def _plan_roles(cfg: OrchConfig, model, plan_fn, precision) -> tuple[tuple, DeviceMemory]:
    """Each running role's plan by ``plan_fn`` and the device memory to hold it against.

    Raises:
        ConfigError: a layout the plan cannot split (``plan_fn``'s ValueError).
    """
    try:
        layouts = with_communicators(cfg, model, role_layouts(cfg))
        roles = tuple(plan_fn(model, lay, precision) for lay in layouts)
        return roles, device_memory(cfg.platform().device_type, cfg.cluster.device_memory_gb)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _v4_memory_plan(cfg: OrchConfig, raw: dict, source: str) -> MemoryPlan:
    """:func:`build_memory_plan` of a DeepSeek-V4 config.json (:mod:`.memory_plan_v4`)."""
    try:
        model = V4Config.from_dict(raw)
    except CheckpointError as exc:
        raise UnservableModelError(f"{source}: {exc}") from None
    precision = V4Precision.for_checkpoint(raw, cfg.model.dtype, cfg.model.fp8_storage)
    roles, memory = _plan_roles(cfg, model, plan_role_v4, precision)
    return MemoryPlan(model, source, precision, roles, memory, plan_role_v4)


def check_memory(cfg: OrchConfig) -> str:
    """Check the plan against the device memory; one report line when it fits.

    Raises:
        MemoryPlanError: a rank (or, on cpu, all ranks together) needs more than the device
            has; the message says by how much and what to change.
        ConfigError: see :func:`build_memory_plan`.
    """
    plan, source = build_memory_plan(cfg)
    if plan is None:
        return f"memory plan: not checked ({source})"
    problems = _problems(plan)
    if problems:
        raise MemoryPlanError("the layout does not fit the device memory:\n- "
                              + "\n- ".join(problems))
    return f"memory plan: fits {plan.memory.source} ({_gb(plan.memory.bytes)} GB)"


def _problems(plan: MemoryPlan) -> list[str]:
    have = plan.memory.bytes
    if plan.memory.shared:
        need = plan.all_ranks_bytes
        if need <= have:
            return []
        return [f"all ranks together need {_gb(need)} GB but {plan.memory.source} is "
                f"{_gb(have)} GB: exceeds it by {_gb(need - have)} GB ({need / have:.2f}x); "
                "lower num_kv_blocks, max_num_batched_tokens or dp, turn ep on, or set "
                "cluster.device_memory_gb"]
    return [_rank_problem(plan, role) for role in plan.roles
            if role.total_bytes > have]


def _rank_problem(plan: MemoryPlan, role: RolePlan) -> str:
    lay, need, have = role.layout, role.total_bytes, plan.memory.bytes
    comm = role.bytes_of("communicators")
    comm = f", communicators {_gb(comm)}" if comm else ""
    head = (f"{lay.role}: one rank needs {_gb(need)} GB (weights {_gb(role.bytes_of('weights'))}"
            f", KV {_gb(role.bytes_of('kv'))}, workspace {_gb(role.bytes_of('workspace'))}"
            f"{comm}) but the device has {_gb(have)} GB ({plan.memory.source}): exceeds it by "
            f"{_gb(need - have)} GB ({need / have:.2f}x)")
    return f"{head}. To fit: {'; '.join(_fixes(plan, role))}"


def _fixes(plan: MemoryPlan, role: RolePlan) -> list[str]:
    """What to change for ``role`` to fit, with the per-rank bytes each change gives."""
    lay, have, fixes = role.layout, plan.memory.bytes, []
    key = lay.section
    experts = plan.model.n_routed_experts or 0
    if not lay.ep and experts and experts % lay.ranks == 0:
        on = plan.plan_fn(plan.model, replace(lay, ep=True), plan.precision).total_bytes
        fixes.append(f"set {key}.ep: true ({_gb(on)} GB per rank, "
                     f"{experts // lay.ranks} experts each)")
    wider = _wider_tp(plan, role) if lay.cp == 1 else None  # NOTE: CP needs tp 1
    if wider is not None and wider.total_bytes <= have:
        fixes.append(f"raise {key}.tp to {wider.layout.tp} ({_gb(wider.total_bytes)} GB per "
                     "rank)")
    most_tokens = _most_step_tokens(plan, role)
    if lay.role != "decode" and most_tokens is not None and most_tokens < lay.step_tokens:
        fixes.append(f"lower {key}.max_num_batched_tokens from {lay.step_tokens} to <= "
                     f"{most_tokens}")
    least = -(-lay.max_model_len // lay.block_size)
    if isinstance(plan.model, V4Config):
        fixes += _v4_pool_fixes(plan, role, least)
    else:
        pool = role.bytes_of("kv")  # NOTE: V3's KV rows are all per block
        per_block = pool / lay.num_kv_blocks
        room = have - (role.total_bytes - pool)
        if room >= least * per_block:
            fixes.append(f"lower {key}.num_kv_blocks from {lay.num_kv_blocks} to <= "
                         f"{math.floor(room / per_block)}")
    fixes.append("or set cluster.device_memory_gb if the device has more")
    return fixes


def _v4_pool_fixes(plan: MemoryPlan, role: RolePlan, least_blocks: int) -> list[str]:
    """DeepSeek-V4's group pools (engine/pool_plan.py) hold ``min(max_num_seqs, what
    num_kv_blocks' budget holds)`` requests: the most ``num_kv_blocks`` (from ``least_blocks``,
    one max_model_len request) and the most ``max_num_seqs`` with which ``role`` fits, each
    found on the plan itself (its bytes grow with both, in steps)."""
    lay, key, out = role.layout, role.layout.section, []
    for name, low in (("num_kv_blocks", least_blocks), ("max_num_seqs", 1)):
        most = _most_fitting(plan, role, name, low)
        if most is not None:
            out.append(f"lower {key}.{name} from {getattr(lay, name)} to <= {most}")
    return out


def _most_fitting(plan: MemoryPlan, role: RolePlan, name: str, low: int) -> int | None:
    """The largest ``low <= v < role.layout.<name>`` with which ``role`` fits, everything else
    unchanged (None: not even ``low``, or lowering changes nothing). Bisection: the plan's
    bytes never fall as ``name`` grows."""
    lay, have = role.layout, plan.memory.bytes

    def fits(v: int) -> bool:
        return plan.plan_fn(plan.model, replace(lay, **{name: v}), plan.precision).total_bytes \
            <= have

    high = getattr(lay, name) - 1
    if high < low or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _most_step_tokens(plan: MemoryPlan, role: RolePlan) -> int | None:
    """The most step tokens with which ``role`` fits, everything else unchanged (None: it
    does not fit even with one)."""
    lay, have = role.layout, plan.memory.bytes
    base = plan.plan_fn(plan.model, replace(lay, step_tokens=0), plan.precision).total_bytes
    per_token = plan.plan_fn(plan.model, replace(lay, step_tokens=1),
                             plan.precision).total_bytes - base
    if per_token <= 0 or base + per_token > have:
        return None
    return (have - base) // per_token


def _wider_tp(plan: MemoryPlan, role: RolePlan) -> RolePlan | None:
    """The plan with tp doubled, when the model can be split that way (and ep still divides;
    the plan functions raise ValueError otherwise)."""
    try:
        return plan.plan_fn(plan.model, replace(role.layout, tp=role.layout.tp * 2),
                            plan.precision)
    except ValueError:
        return None


def _gb(n: float) -> str:
    return f"{n / GB:.2f}"


def describe_memory(cfg: OrchConfig) -> list[str]:
    """Report lines for ``orch up --dry-run``: per role, a table of what one rank holds by
    kind (elements, bytes per element, GB, how it is split) with totals against the device.
    No lines when there is no plan: :func:`check_memory`'s one line says why (the dry run
    prints both, so the reason appears once).

    Raises:
        ConfigError: see :func:`build_memory_plan`.
    """
    plan, source = build_memory_plan(cfg)
    if plan is None:
        return []
    mem = plan.memory
    quant = None if isinstance(plan.model, V4Config) else plan.model.quantization
    stored = "" if quant is None else \
        f", linear weights {quant.method} checkpoint stored at {plan.precision.linear:.4g} B/el"
    if isinstance(plan.precision, V4Precision):
        stored = (f", DeepSeek-V4: linears {plan.precision.linear:.4g} B/el, routed experts "
                  f"{plan.precision.expert:.4g} B/el")
    lines = [f"memory plan per rank ({cfg.model.dtype}{stored}; GB = 10^9 bytes; model "
             f"{source}; device {_gb(mem.bytes)} GB: {mem.source})"]
    for role in plan.roles:
        lines += _role_table(role, None if mem.shared else mem.bytes)
        if isinstance(plan.model, V4Config):
            lines.append(pools_line(plan.model, role.layout))
            lines.append(request_line(plan.model, role.layout.max_model_len,
                                      plan.precision.kv))
        lines.append(_prefix_cache_line(cfg, role.layout))
    if mem.shared:
        ranks = sum(p.layout.ranks for p in plan.roles)
        lines.append(f"all {ranks} rank(s) together: {_gb(plan.all_ranks_bytes)} GB of "
                     f"{_gb(mem.bytes)} GB: {_headroom(plan.all_ranks_bytes, mem.bytes)}")
    return lines


def _role_table(role: RolePlan, device_bytes: int | None) -> list[str]:
    lay = role.layout
    ep = f"ep on (EP {lay.ep_size})" if lay.ep else "ep off"
    # NOTE: MB for small (tiny-model) plans, so their rows do not all read 0.00
    unit, scale = ("GB", GB) if role.total_bytes >= GB else ("MB", GB // 1000)

    def size(n: int) -> str:
        return f"{n / scale:>10.2f}"

    cp = f" x cp {lay.cp}" if lay.cp > 1 else ""
    lines = [f"{lay.role}: dp {lay.dp} x tp {lay.tp}{cp}, {ep}; each of its {lay.ranks} "
             "rank(s) holds:",
             f"  {'kind':<24}{'elements':>17}{'B/el':>7}{unit:>10}  split"]
    for row in role.rows:
        lines.append(f"  {row.kind:<24}{row.elements:>17,}{row.bytes_per_element:>7.4g}"
                     f"{size(row.bytes)}  {row.split}")
    for group in ("weights", "kv", "workspace", "communicators"):
        if group != "communicators" or role.bytes_of(group):
            lines.append(f"  {group + ' (sum)':<48}{size(role.bytes_of(group))}")
    total = f"  {'total':<48}{size(role.total_bytes)}"
    if device_bytes is not None:
        total += f"  of {_gb(device_bytes)} GB: {_headroom(role.total_bytes, device_bytes)}"
    return lines + [total]


def _prefix_cache_line(cfg: OrchConfig, lay: RoleLayout) -> str:
    """The KV pool as the prefix cache (docs/prefix_cache.md): nothing extra is allocated."""
    section = lay.section
    if not getattr(cfg, section).prefix_cache:
        return f"  prefix cache: off ({section}.prefix_cache: false)"
    return (f"  prefix cache: in the KV pool (no extra memory): up to {lay.num_kv_blocks} "
            f"blocks ({lay.num_kv_blocks * lay.block_size:,} tokens) per DP rank of finished "
            "requests stay findable while no request holds them, least recently freed evicted "
            f"first; {section}.prefix_cache: false turns it off")


def _headroom(need: int, have: int) -> str:
    if need > have:
        return f"EXCEEDS by {_gb(need - have)} GB"
    return f"headroom {_gb(have - need)} GB ({100 * (have - need) / have:.1f} %)"

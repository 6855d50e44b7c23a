"""The workload a plan is for, and the operating point it reaches (queueing, batch, rate).

Two load models:

- closed loop (``concurrency=C``; the default C fills every decode slot, ``dp x`` the
  requests one decode DP rank holds): C requests always in flight, each a new one as soon as
  one ends. Throughput X = min(C / (prefill + transfer + out x TPOT), prefill capacity,
  decode capacity); TTFT by Little's law, C / X - out x TPOT (so queueing before prefill is
  in it when prefill is the bottleneck).
- open loop (``rate=R`` requests/s, Poisson): each prefill DP rank an M/D/1 queue, TTFT =
  wait + prefill + transfer; over capacity the plan says so (TTFT unbounded).
- lock-step closed loop (``concurrency=C,start=together``): what a closed-loop bench of
  equal requests does: the C requests start together, each prefill DP rank takes its share
  n_p = ceil(C / prefill dp) one after another (they reach the rank one placement's calls
  apart and its loop starts a step on the first one, so the k-th waits for the k-1 before
  it: TTFT_k = calls + k x prefill); all decode together at batch n_d = ceil(C / decode dp)
  (a colocated rank has no other prefills meanwhile), their KV transfers one after another
  before the second tokens; all end together and the next C start together. TTFT is the
  mean over k.

Either way the decode batch per DP rank is X x out x TPOT / dp (Little), solved with the
step time by fixed-point iteration.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.planner.moe import StepOptions


@dataclass(frozen=True)
class WorkloadSpec:
    """Mean request shape and load. ``rate`` (req/s) and ``concurrency`` exclusive; neither:
    closed loop filling the decode slots; ``together`` (with ``concurrency``): the closed
    loop runs in lock-step; ``options``: how the engine runs a step (MTP, overlap, EPLB);
    ``hit``: share of prompt tokens the prefix cache holds on both sides (prefill computes
    and ships only the rest)."""

    input_len: int
    output_len: int
    rate: float | None = None
    concurrency: int | None = None
    together: bool = False  # closed loop in lock-step (module docstring)
    options: StepOptions = field(default_factory=StepOptions)
    hit: float = 0.0  # prefix-cache hit rate: share of prompt tokens cached (prefix_hits.py)


WORKLOAD_HELP = ("in=TOKENS,out=TOKENS[,rate=REQ_PER_S | ,concurrency=N[,start=together]]"
                 "[,hit=P][,mtp=DRAFTS,accept=P][,overlap=0|1][,eplb=0|1][,skew=CV]"
                 "[,drift=CV][,redundant=SLOTS][,sptp=RANKS]")
_KEYS = {"in": int, "out": int, "rate": float, "concurrency": int, "start": str,
         "mtp": int, "accept": float, "overlap": int, "eplb": int, "skew": float,
         "drift": float, "redundant": int, "hit": float, "sptp": int}


def _options(values: dict, text: str) -> StepOptions:
    """The step options among the parsed ``values`` (removed from it).

    Raises:
        ValueError: accept outside [0, 1] or given without mtp, mtp / redundant / skew /
            drift < 0,
            overlap or eplb not 0 or 1, sptp < 1.
    """
    opts = {k: values.pop(k) for k in ("mtp", "accept", "overlap", "eplb", "skew", "drift",
                                       "redundant") if k in values}
    if "sptp" in values:
        opts["attn_tp"] = values.pop("sptp")
    bad = [k for k in ("overlap", "eplb") if opts.get(k, 0) not in (0, 1)]
    bad += ["sptp"] if opts.get("attn_tp", 1) < 1 else []
    bad += [k for k in ("mtp", "redundant", "skew", "drift") if opts.get(k, 0) < 0]
    if not 0 <= opts.get("accept", 0) <= 1 or ("accept" in opts and not opts.get("mtp")):
        bad.append("accept")
    if bad:
        raise ValueError(f"--workload {text!r}: bad {', '.join(bad)}: overlap and eplb are 0 "
                         "or 1, mtp/redundant/skew/drift >= 0, sptp >= 1, accept in [0, 1] with "
                         "mtp >= 1")
    for k in ("overlap", "eplb"):
        if k in opts:
            opts[k] = bool(opts[k])
    return StepOptions(**opts)


def parse_workload(text: str) -> WorkloadSpec:
    """``in=65536,out=3072[,rate=R | ,concurrency=C[,start=together|staggered]]`` plus the
    step options (:data:`WORKLOAD_HELP`, :class:`.moe.StepOptions`) -> :class:`WorkloadSpec`.

    Raises:
        ValueError: an unknown or repeated key, a missing in/out, a bad number (rate not a
            finite number > 0, a length or concurrency < 1, hit outside [0, 1]) or start,
            both rate and concurrency, start without concurrency, a bad step option.
    """
    keys = _KEYS
    values: dict[str, float | str] = {}
    for part in filter(None, text.split(",")):
        key, _, value = (s.strip() for s in part.partition("="))
        if key not in keys:
            raise ValueError(f"--workload: unknown key {key!r} in {text!r}: use "
                             + WORKLOAD_HELP)
        if key in values:
            raise ValueError(f"--workload {text!r}: {key}= given twice")
        try:
            values[key] = keys[key](value)
        except ValueError:
            raise ValueError(f"--workload {text!r}: {key}={value!r} is not "
                             f"{'a whole number' if keys[key] is int else 'a number'}") from None
    options = _options(values, text)
    start = values.pop("start", "staggered")
    if start not in ("together", "staggered") or ("concurrency" not in values
                                                  and start == "together"):
        raise ValueError(f"--workload {text!r}: start= is together or staggered, with "
                         "concurrency=")
    if "in" not in values or "out" not in values:
        raise ValueError(f"--workload {text!r} needs in= and out= (tokens), e.g. "
                         "in=65536,out=3072")
    if "rate" in values and "concurrency" in values:
        raise ValueError("--workload: give rate= (open loop) or concurrency= (closed loop), "
                         "not both")
    hit = values.get("hit", 0.0)
    if not 0.0 <= hit <= 1.0:
        raise ValueError(f"--workload {text!r}: hit= is the share of prompt tokens the prefix "
                         "cache holds, in [0, 1]")
    spec = WorkloadSpec(int(values["in"]), int(values["out"]), values.get("rate"),
                        values.get("concurrency"), start == "together", options, hit)
    rate_ok = spec.rate is None or (math.isfinite(spec.rate) and spec.rate > 0)
    if min(spec.input_len, spec.output_len) < 1 or not rate_ok \
            or (spec.concurrency is not None and spec.concurrency < 1):
        raise ValueError(f"--workload {text!r}: lengths, rate and concurrency must be > 0")
    return spec


@dataclass(frozen=True)
class Roles:
    """What the load model needs of the layout: per-request seconds and step times."""

    prefill_s: float            # one request on one prefill DP rank
    calls_s: float              # the router's calls and the first token's way out
    step_s: Callable[[float], float]   # decode step seconds at a batch per DP rank
    prefill_dp: int
    decode_dp: int
    slots: int                  # requests one decode DP rank holds at once
    colocated: bool
    kv_s: float = 0.0           # its KV to decode: after the first token, before the second


@dataclass(frozen=True)
class OperatingPoint:
    """Predicted figures; ``bound`` names what limits throughput."""

    ttft_s: float
    tpot_s: float
    requests_s: float
    output_tok_s: float
    decode_batch: float
    concurrency: float
    bound: str


def _capacities(r: Roles, out: int) -> tuple[float, float]:
    """(prefill, decode) requests/s the layout can sustain."""
    return r.prefill_dp / r.prefill_s, r.decode_dp * r.slots / (out * r.step_s(r.slots))


def _tpot(r: Roles, batch: float, rate: float, others: float = 1.0) -> float:
    """Time per output token: the step, stretched in colocated ranks by the share of time
    the prefills of ``others`` (the share of prefills that are not the request's own: 1 in
    an open loop, 1 - dp / C in a closed loop of C) take."""
    step = r.step_s(batch)
    if not r.colocated:
        return step
    busy = min(0.95, rate * r.prefill_s / r.prefill_dp * others)
    return step / (1 - busy)


def operating_point(r: Roles, wl: WorkloadSpec) -> OperatingPoint:
    """The steady state of ``wl`` on the layout (see the module docstring)."""
    cap_p, cap_d = _capacities(r, wl.output_len)
    if wl.rate is not None:
        return _open_loop(r, wl, cap_p, cap_d)
    if wl.together:
        return _lockstep(r, wl)
    conc = wl.concurrency or r.decode_dp * r.slots
    others = max(0.0, 1 - r.prefill_dp / conc)
    batch, rate, bound = float(r.slots), 0.0, "load"
    for _ in range(100):
        tpot = _tpot(r, batch, rate, others)
        rate = min(conc / (r.prefill_s + r.calls_s + r.kv_s + wl.output_len * tpot), cap_p,
                   cap_d)
        bound = "prefill" if rate == cap_p else "decode" if rate == cap_d else "load"
        batch = 0.5 * batch + 0.5 * min(r.slots, max(1.0, rate * wl.output_len * tpot
                                                      / r.decode_dp))
    step = _tpot(r, batch, rate, others)
    ttft = max(r.prefill_s + r.calls_s, conc / rate - r.kv_s - wl.output_len * step)
    return OperatingPoint(ttft, _seen_tpot(r, step, wl.output_len), rate,
                          rate * wl.output_len, batch, conc, bound)


def _seen_tpot(r: Roles, step: float, out: int) -> float:
    """TPOT as a client measures it, (last - first token) / (out - 1): the steps, and once
    the KV transfer (the first token comes from prefill, the second after the transfer)."""
    return step + r.kv_s / max(1, out - 1)


def _open_loop(r: Roles, wl: WorkloadSpec, cap_p: float, cap_d: float) -> OperatingPoint:
    rate = wl.rate
    if rate >= min(cap_p, cap_d):
        bound = "prefill" if cap_p <= cap_d else "decode"
        rate = min(cap_p, cap_d)
        tpot = _tpot(r, r.slots, rate)
        return OperatingPoint(math.inf, tpot, rate, rate * wl.output_len, r.slots, math.inf,
                              f"{bound} (overloaded: {wl.rate:.3g} req/s > capacity "
                              f"{rate:.3g} req/s)")
    rho = rate * r.prefill_s / r.prefill_dp
    wait = rho * r.prefill_s / (2 * (1 - rho))
    batch = 1.0
    for _ in range(100):
        tpot = _tpot(r, batch, rate)
        batch = 0.5 * batch + 0.5 * min(r.slots, max(1.0, rate * wl.output_len * tpot
                                                      / r.decode_dp))
    ttft = wait + r.prefill_s + r.calls_s
    conc = rate * (ttft + r.kv_s + wl.output_len * tpot)
    return OperatingPoint(ttft, _seen_tpot(r, tpot, wl.output_len), rate,
                          rate * wl.output_len, batch, conc, "load")


def _lockstep(r: Roles, wl: WorkloadSpec) -> OperatingPoint:
    """``wl.concurrency`` requests starting together, in waves (module docstring)."""
    conc = wl.concurrency or r.decode_dp * r.slots
    n_p, n_d = -(-conc // r.prefill_dp), min(r.slots, -(-conc // r.decode_dp))
    ttfts = [r.calls_s + k * r.prefill_s for k in range(1, n_p + 1)]
    tpot = r.step_s(n_d) + n_p * r.kv_s / max(1, wl.output_len - 1)
    rate = conc / (ttfts[-1] + (wl.output_len - 1) * tpot)
    return OperatingPoint(sum(ttfts) / n_p, tpot, rate, rate * wl.output_len, n_d, conc,
                          "load (lock-step)")

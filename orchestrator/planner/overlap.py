"""How a step adds its terms up: one batch (the sum), or two micro-batches as the engines
schedule them, each phase of one micro-batch beside the communication of the other.

The schedules are DeepSeek's (github.com/deepseek-ai/profile-data README diagrams; SGLang's
two-batch overlap follows them), per layer, ``x`` one micro-batch's share (half the step's
total of that phase):

- prefill (the normal all-to-all holds some compute units):
  ``[attn + shared] | combine``, ``attn | dispatch``, ``moe | dispatch``,
  ``[moe + shared] | combine``: the step is
  ``(max(A + S, C) + max(A, D) + max(M, D) + max(M + S, C)) / 2``;
- decode (the low-latency all-to-all holds none):
  ``[shared + attn-0] | dispatch``, ``moe`` alone, ``attn-1 | combine``, per micro-batch:
  ``max(S + A0, D) + M + max(A1, C)``;

where ``A0`` is the attention block before the core (MLA down / up projections, the dense
MLP layers, norms, RoPE), ``A1`` the core attention, output projection and router gate,
``A = A0 + A1``, ``S`` shared experts, ``M`` routed experts, ``D`` / ``C`` the dispatch /
combine; serial terms (TP collectives, host) are added to every schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

PRE, ATTN, SHARED, MOE = "attention-0", "attention", "shared", "moe"
DISPATCH, COMBINE, SERIAL = "dispatch", "combine", "serial"
PHASES = (PRE, ATTN, SHARED, MOE, DISPATCH, COMBINE, SERIAL)
NONE, PREFILL, DECODE = "none", "prefill", "decode"


@dataclass(frozen=True)
class Phases:
    """Seconds of each phase over the whole step (both micro-batches), s."""

    pre: float
    attn: float
    shared: float
    moe: float
    dispatch: float
    combine: float
    serial: float


def step_s(p: Phases, schedule: str) -> float:
    """The step's seconds under ``schedule`` (NONE, PREFILL or DECODE; module docstring).

    Raises:
        ValueError: an unknown schedule.
    """
    if schedule == NONE:
        return p.pre + p.attn + p.shared + p.moe + p.dispatch + p.combine + p.serial
    return sum(side for side, _ in _segments(p, schedule)) + p.serial


def _segments(p: Phases, schedule: str) -> list[tuple[float, str]]:
    """(seconds, what bounds it) of each segment of an overlapped step."""
    a = p.pre + p.attn
    if schedule == PREFILL:
        pairs = ((a + p.shared, "attention + shared", p.combine, "combine"),
                 (a, "attention", p.dispatch, "dispatch"),
                 (p.moe, "MoE", p.dispatch, "dispatch"),
                 (p.moe + p.shared, "MoE + shared", p.combine, "combine"))
        return [(max(x, y) / 2, nx if x >= y else ny) for x, nx, y, ny in pairs]
    if schedule == DECODE:
        first = (p.shared + p.pre, "shared + attention-0", p.dispatch, "dispatch")
        last = (p.attn, "attention", p.combine, "combine")
        return [(max(x, y), nx if x >= y else ny) for x, nx, y, ny in (first, last)] \
            + [(p.moe, "MoE (alone)")]
    raise ValueError(f"unknown overlap schedule {schedule!r}: one of {NONE}, {PREFILL}, "
                     f"{DECODE}")


def explain(p: Phases, schedule: str, scale: float, unit: str) -> str:
    """One line: how the phases add up and which side bounds each segment."""
    if schedule == NONE:
        parts = " + ".join(f"{name} {v * scale:.3g}" for name, v in zip(PHASES, vars(p)
                                                                          .values()))
        return f"no overlap: {parts} = {step_s(p, schedule) * scale:.3g} {unit}"
    segs = ", ".join(f"{name} {v * scale:.3g}" for v, name in _segments(p, schedule))
    rule = ("(max(A+S, C) + max(A, D) + max(M, D) + max(M+S, C)) / 2" if schedule == PREFILL
            else "max(S+A0, D) + M + max(A1, C)")
    return (f"overlap (two micro-batches, {schedule} schedule {rule}): segments bound by "
            f"{segs}; + serial {p.serial * scale:.3g} = {step_s(p, schedule) * scale:.3g} "
            f"{unit}")

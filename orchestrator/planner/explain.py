"""``orch plan --explain``: every term of a cost, and which one bounds the step.

One line per term (seconds in the caller's unit, what limits it), then how the step adds
them up: without overlap the sum; with two micro-batches ``max(attention, dispatch) +
max(MoE, combine) + serial``, naming the larger side of each phase; then the MTP tokens per
step and the EP imbalance the MoE terms ran with.
"""

from __future__ import annotations

from orchestrator.planner.cost import ATTN, COMBINE, DISPATCH, MOE, SERIAL, Cost


def cost_lines(c: Cost, scale: float, unit: str, indent: str = "") -> list[str]:
    """The explanation of ``c`` (``scale``: seconds -> ``unit``)."""
    lines = [f"{indent}{t.name} [{t.phase}, {t.bound}]: {t.seconds * scale:.3g} {unit}"
             for t in c.terms if t.seconds > 0]
    a, m, d, k = (c.phase_s(p) * scale for p in (ATTN, MOE, DISPATCH, COMBINE))
    serial = c.phase_s(SERIAL) * scale
    if c.overlap:
        first = "attention" if a >= d else "dispatch"
        second = "MoE" if m >= k else "combine"
        lines.append(f"{indent}overlap (two micro-batches): max(attention {a:.3g}, dispatch "
                     f"{d:.3g}) + max(MoE {m:.3g}, combine {k:.3g}) + serial {serial:.3g} = "
                     f"{c.total_s * scale:.3g} {unit}; bound by {first} then {second}")
    else:
        lines.append(f"{indent}no overlap: attention {a:.3g} + MoE {m:.3g} + dispatch {d:.3g}"
                     f" + combine {k:.3g} + serial {serial:.3g} = {c.total_s * scale:.3g} "
                     f"{unit}")
    if c.tokens_per_step != 1.0:
        lines.append(f"{indent}MTP: {c.tokens_per_step:.3g} tokens per step -> "
                     f"{c.total_s * scale / c.tokens_per_step:.3g} {unit} per token")
    if c.imbalance != 1.0:
        lines.append(f"{indent}expert-load imbalance (max/mean routed tokens per rank): "
                     f"{c.imbalance:.3g}")
    return lines

"""``orch plan --explain``: every term of a cost, and which one bounds the step.

One line per term (seconds in the caller's unit, its phase, what limits it), then how the
step adds them up (:mod:`.overlap`: the sum, or the two-micro-batch schedule naming the
larger side of each segment); then the MTP tokens per step and the EP imbalance the MoE
terms ran with.
"""

from __future__ import annotations

from orchestrator.planner.terms import Cost
from orchestrator.planner.overlap import explain


def cost_lines(c: Cost, scale: float, unit: str, indent: str = "") -> list[str]:
    """The explanation of ``c`` (``scale``: seconds -> ``unit``)."""
    lines = [f"{indent}{t.name} [{t.phase}, {t.bound}]: {t.seconds * scale:.3g} {unit}"
             for t in c.terms if t.seconds > 0]
    lines.append(indent + explain(c.phases, c.schedule, scale, unit))
    if c.tokens_per_step != 1.0:
        lines.append(f"{indent}MTP: {c.tokens_per_step:.3g} tokens per step -> "
                     f"{c.total_s * scale / c.tokens_per_step:.3g} {unit} per token")
    if c.imbalance != 1.0:
        lines.append(f"{indent}expert-load imbalance (max/mean routed tokens per rank): "
                     f"{c.imbalance:.3g}")
    return lines

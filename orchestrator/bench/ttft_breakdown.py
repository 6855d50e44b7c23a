"""The server's TTFT breakdown over an ``orch bench`` run.

The router sends, with each request's final stats, where the time to its first token went
(``GenerateStats.ttft_phases``, phase -> seconds; the phases are
``orchestrator.router.request.TTFT_PHASES``, docs/performance.md "TTFT breakdown"). The bench
keeps them per request (``RequestRecord.ttft_phases``) and reports the median of each phase;
the phases of one request add up to the router's span from opening it to handing its first
chunk to the server, which the client's TTFT exceeds only by the gRPC hops.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from orchestrator.bench.records import RequestRecord
from orchestrator.router.request import TTFT_PHASES


def ttft_breakdown(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Phase -> p50 milliseconds over the ``records`` that carry a breakdown, in
    ``TTFT_PHASES`` order (unknown phases after them, by name); empty when none carries one."""
    carrying = [r.ttft_phases for r in records if r.ttft_phases]
    if not carrying:
        return {}
    names = [p for p in TTFT_PHASES if any(p in c for c in carrying)]
    names += sorted({p for c in carrying for p in c} - set(TTFT_PHASES))
    return {p: float(np.median([c.get(p, 0.0) for c in carrying])) * 1e3 for p in names}


def format_ttft_breakdown(phases_ms: dict[str, float], ttft_p50_ms: float | None) -> str:
    """One line: each phase's p50 (ms), their sum and the client's TTFT p50.

    NOTE: a sum of medians is not the median of sums; on a steady run they are close."""
    parts = ", ".join(f"{p} {ms:.2f}" for p, ms in phases_ms.items())
    client = "-" if ttft_p50_ms is None else f"{ttft_p50_ms:.2f}"
    return (f"TTFT breakdown (server, p50 ms): {parts}; sum {sum(phases_ms.values()):.2f} "
            f"vs client TTFT p50 {client}")

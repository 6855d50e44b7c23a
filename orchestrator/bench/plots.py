"""CDF plots of a report's per-request TTFT and TPOT (matplotlib, Agg backend: no display)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from orchestrator.bench.report import BenchReport

_PLOTTED = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))


def write_cdf_plots(report: BenchReport, out_dir: str | Path) -> list[Path]:
    """Write ``<label>_ttft_cdf.png`` and ``<label>_tpot_cdf.png`` into ``out_dir``.

    Empirical CDFs (x: milliseconds); a metric with no values still gets a figure saying so,
    so the set of files does not depend on the data. Returns the written paths.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = (report.label or "bench").replace("/", "_").replace(" ", "_")
    paths: list[Path] = []
    for key, title in _PLOTTED:
        values = np.sort([r[key] for r in report.requests if r[key] is not None])
        fig, ax = plt.subplots(figsize=(6, 4))
        try:
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
            else:
                ax.text(0.5, 0.5, f"no {title} values", ha="center", transform=ax.transAxes)
            ax.set_xlabel(f"{title} (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_ylim(0, 1.02)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{title} CDF: {report.label or report.workload}"[:80])
            path = out_dir / f"{stem}_{key.split('_')[0]}_cdf.png"
            fig.savefig(path, dpi=100, bbox_inches="tight")
            paths.append(path)
        finally:
            plt.close(fig)
    return paths

"""TTFT before / after on this machine (issue 36): `orch up configs/colocated.yaml` and
`orch up configs/1p1d.yaml` (prefill tp 1 -> decode tp 1) both up on one private Ray, then
`orch bench` (synthetic 256-token prompts, 64 output tokens, 2 warm-up requests) at each
concurrency against each in turn, ``--rounds`` times; prints each report's TTFT / TPOT lines
and its TTFT breakdown (docs/performance.md, "TTFT breakdown and the first token's path").

    PYTHONPATH=$PWD .venv/bin/python benchmarks/ttft_bench.py --out /tmp/ttft [--rounds 2]

Both configs get 256 KV blocks a side (colocated.yaml's 64 cap a 256 + 64 workload at 3
requests at once), ``ORCH_TORCH_THREADS=1`` and ``ORCH_RANK_NICE=0``. The reports go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = ("colocated", "1p1d")
LEVELS = ((1, 16), (8, 32))  # (concurrency, timed requests)
KEPT = ("TTFT", "TPOT", "throughput", "failed")


def bench(address: str, name: str, conc: int, n: int, seed: int, report: Path) -> str:
    """One `orch bench` replay; its output's kept lines.

    Raises:
        subprocess.TimeoutExpired: the replay took over 10 minutes.
    """
    cmd = [str(REPO / ".venv" / "bin" / "orch"), "bench", "--address", address,
           "--workload", "synthetic", "--input-len", "256", "--output-len", "64",
           "--num-requests", str(n), "--warmup", "2", "--max-concurrency", str(conc),
           "--no-progress", "--label", f"{name}-c{conc}", "--output", str(report),
           "--seed", str(seed)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return "\n".join(line for line in (res.stdout + res.stderr).splitlines()
                     if any(k in line for k in KEPT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for configs, logs, reports")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    import ray

    from tests.e2e.harness import OrchProcess

    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.update(ORCH_TORCH_THREADS="1", ORCH_RANK_NICE="0", RAY_ADDRESS="")
    ray.init(address="local", num_cpus=8, include_dashboard=False)
    over = {"cluster.address": ray.get_runtime_context().gcs_address,
            "cluster.bind_host": "127.0.0.1", "decode.num_kv_blocks": 256,
            "prefill.num_kv_blocks": 256}
    procs: dict[str, OrchProcess] = {}
    try:
        for name in CONFIGS:
            procs[name] = OrchProcess(REPO / "configs" / f"{name}.yaml", args.out, over)
            procs[name].__enter__()
        for r in range(args.rounds):
            for conc, n in LEVELS:
                for name, orch in procs.items():
                    report = args.out / f"{name}_c{conc}_r{r}.json"
                    print(f"== {name} c={conc} round {r}\n"
                          f"{bench(orch.address, name, conc, n, r + 10 * conc, report)}",
                          flush=True)
    finally:
        for orch in procs.values():
            orch.stop()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

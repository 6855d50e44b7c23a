"""The ``cpu`` device, measured on this machine by a short run (a few seconds) and cached.

Measured, with one torch thread as each rank uses (``ORCH_TORCH_THREADS`` default 1), at
float32 (the tiny model's dtype):

- matmul FLOP/s: a 512 x 512 x 512 matmul, best of a few;
- memory bandwidth as a decode step streams weights: a matrix-vector product over a 33 MB
  weight with 64 inputs (the narrow shape of the tiny model's layers and lm_head; a plain
  memcpy runs about 2x faster than this on the machine it was written on);
- control call: the round trip of a Ray actor call carrying a small step list (median of 30),
  on the Ray this process already runs, else on a private local one started for it (~5 s);
- host dispatch: one decode step (batch 1) and one 64-token prefill of the built-in tiny
  model (:class:`engine.runner.ModelRunner`), less what their FLOPs and bytes take at the
  rates above, solved for a cost per layer and a cost per routed expert a MoE layer runs
  (the eager engine loops over the experts a step picks; a decode step picks fewer);
- serving cost per step: a served tiny request's token gap less the bare engine decode step
  (:mod:`.calibrate_serving`), on the same Ray as the control call; and the first token's
  cost, colocated and disaggregated: the served time to first token (requests sent to a
  router in this process, as the rest of the served figures) less the calls in turn on its
  way (1 or 3), the bare prefill and that serving cost (the event path of a lone
  event, not overlapped with a next step; disaggregated also the reservation's own work and
  the prefill rank's KV sends competing with the first token);
- gloo loopback: two ranks (threads) exchanging 16 MB over a gloo group on 127.0.0.1, and
  the round trip of a 4-byte all-reduce;
- collective latency as a served TP step meets it: the token gap of a request's decode on a
  TP2 decode instance (two rank actors) over that of a single rank, less the leader's step
  call, per collective (at least the idle round trip above): with the ranks, their Ray threads
  and the event path sharing few cores each collective also waits for the other rank to be
  scheduled (a two-core machine runs 3-5 busy processes per served TP2 step);

Cached as JSON in ``$ORCH_CACHE_DIR`` (else ``~/.cache/orch``) ``/planner_cpu.json``; the
machine's load changes the figures, so a comparison measures them in the same run, just
before.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine import envs
from orchestrator.deploy.ray_connect import quiet_token_auth_notice
from orchestrator.planner.specs import DeviceSpec

if TYPE_CHECKING:
    from orchestrator.planner.calibrate_serving import ServedInstances, ServedSteps

CACHE_NAME = "planner_cpu.json"
GLOO_BYTES = 16 * 2**20
PROMPT = 64  # tokens of the timed tiny prefill


def cache_path() -> Path:
    root = envs.ORCH_CACHE_DIR.get() or os.path.expanduser("~/.cache/orch")
    return Path(root) / CACHE_NAME


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _local_rates() -> dict[str, float]:
    import torch

    torch.set_num_threads(envs.ORCH_TORCH_THREADS.get())
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    flops = 2 * 512**3 / _best(lambda: a @ b, 10)
    w, x = torch.randn(129280, 64), torch.randn(1, 64)  # 33 MB of float32
    gemv_s = _best(lambda: torch.nn.functional.linear(x, w), 10)
    return {"flops": flops, "stream_gb_s": w.numel() * 4 / gemv_s / 1e9}


def _gloo_pair(rank: int, store, out: dict) -> None:
    """One side of an in-process 2-rank gloo group: latency of a 4-byte all-reduce, then
    (rank 0) the bandwidth of 4 x 16 MB sent to rank 1."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    buf, small = torch.empty(GLOO_BYTES // 4), torch.zeros(1)
    pg.allreduce([small]).wait()  # warm the connection
    out[f"lat{rank}"] = _best(lambda: pg.allreduce([small]).wait(), 20)
    t0 = time.perf_counter()
    for _ in range(4):
        (pg.send([buf], 1, 0) if rank == 0 else pg.recv([buf], 0, 0)).wait()
    pg.allreduce([small]).wait()
    out[f"bw{rank}"] = 4 * GLOO_BYTES / (time.perf_counter() - t0) / 1e9


def _gloo_rates() -> dict[str, float]:
    """Gloo loopback bandwidth (GB/s) and small all-reduce latency (us): two ranks in two
    threads of this process, over 127.0.0.1.

    Raises:
        RuntimeError: the pair did not finish within 120 s.
    """
    import threading

    import torch.distributed as dist

    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_gloo_pair, args=(r, store, out), daemon=True)
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if "bw0" not in out or "lat0" not in out:
        raise RuntimeError("gloo calibration pair did not finish within 120 s")
    return {"gloo_gb_s": out["bw0"], "gloo_latency_us": out["lat0"] * 1e6}


def _ray_figures(ckpt: Path, served: "ServedInstances | None"
                 ) -> tuple[float, float, "ServedSteps"]:
    """(Ray actor call round trip in us, a leader call's round trip over its call socket in
    us, the served steps of ``served``, else of :class:`.calibrate_serving.ServedInstances`
    brought up for them), on the Ray this process runs, else on a private local one started
    for them.

    Raises:
        see :meth:`.calibrate_serving.ServedInstances.measure`; BringUpError: its instances
            did not come up.
    """
    import ray

    from orchestrator.planner.calibrate_serving import ServedInstances

    own = not ray.is_initialized()
    if own:
        quiet_token_auth_notice()
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        if served is not None:
            return _ray_call_us(), served.socket_call_us(), served.measure()
        with ServedInstances(ckpt) as fresh:
            return _ray_call_us(), fresh.socket_call_us(), fresh.measure()
    finally:
        if own:
            ray.shutdown()


def _ray_call_us() -> float:
    """Median round trip of a Ray actor call with a small payload, us (Ray initialised).

    Raises:
        ray.exceptions.GetTimeoutError: a call took over 30 s.
    """
    import ray

    echo = ray.remote(num_cpus=0)(_Echo).remote()
    payload = [(f"r{i}", tuple(range(64)), 64, tuple(range(8))) for i in range(8)]
    for _ in range(10):  # NOTE: warm: the first calls start the worker and its imports
        ray.get(echo.ping.remote(payload), timeout=30)
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        ray.get(echo.ping.remote(payload), timeout=30)
        times.append(time.perf_counter() - t0)
    ray.kill(echo)
    return sorted(times)[len(times) // 2] * 1e6


class _Echo:
    """The actor :func:`_ray_call_us` calls."""

    def ping(self, payload: list) -> int:
        return len(payload)


def _tiny_step_s(ckpt: Path) -> tuple[float, float]:
    """(seconds of a 64-token prefill, of a batch-1 decode step) of the tiny checkpoint
    ``ckpt``: the median of a few after a warm-up (a median, as the load a server sees is
    typical, not the best case)."""
    from engine.runner import ModelRunner, SeqStep

    runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=16)
    table = tuple(range(8))
    prompt = SeqStep("p", tuple(range(1000, 1000 + PROMPT)), 0, table)
    step = SeqStep("p", (7,), PROMPT, table)
    runner.execute([prompt])
    times: list[list[float]] = [[], []]
    for _ in range(9):  # NOTE: interleaved, so a burst of load elsewhere hits both alike
        for i, seq in enumerate((prompt, step)):
            t0 = time.perf_counter()
            runner.execute([seq])
            times[i].append(time.perf_counter() - t0)
    return sorted(times[0])[4], sorted(times[1])[4]


def _collective_latency_us(m_layers: int, served: "ServedSteps", call_us: float,
                           floor_us: float) -> float:
    """The latency one TP collective costs inside a served step: the served TP2 decode
    step's extra time over the served single rank (``served``), less the
    leader's step call ``call_us``, per collective it meets (two per layer, the embedding's
    all-reduce, the logits' all-gather); at least ``floor_us`` (two idle ranks' round trip).
    NOTE: on a machine with few cores this is far more than the idle round trip: each
    collective waits for the other rank to be scheduled, among the follower's Ray call
    threads, the event path and whatever else runs."""
    extra_us = (served.tp2_gap_s - served.tp1_gap_s) * 1e6 - call_us
    return max(floor_us, extra_us / (2 * m_layers + 2))


def _host_costs(raw: DeviceSpec, prefill_s: float, decode_s: float) -> tuple[float, float]:
    """(us per layer, us per routed expert run) of host dispatch: the tiny model's measured
    step times less their FLOP and byte time on ``raw``."""
    from engine.model_config import ModelConfig
    from orchestrator.config.memory_plan import Precision, plan_role
    from orchestrator.config.role_layout import RoleLayout
    from orchestrator.config.weight_rows import num_moe_layers
    from orchestrator.planner.cost import decode_step_cost, prefill_cost
    from orchestrator.planner.hardware import Hardware
    from orchestrator.planner.counts import expert_active_share
    from orchestrator.tiny_model import tiny_config_dict

    m = ModelConfig.from_dict(tiny_config_dict())
    lay = RoleLayout("colocated", 1, 1, False, 8, 16, PROMPT, 1, 128)
    prec = Precision.of("float32")
    plan, hw = plan_role(m, lay, prec), Hardware(raw)
    host_pre = prefill_s - prefill_cost(m, plan, prec, hw, PROMPT, PROMPT).total_s
    host_dec = decode_s - decode_step_cost(m, plan, prec, hw, 1, PROMPT).total_s
    moe, layers = num_moe_layers(m), m.num_hidden_layers
    experts = [moe * m.n_routed_experts * expert_active_share(m, n) for n in (PROMPT, 1)]
    per_expert = max(0.0, (host_pre - host_dec) / (experts[0] - experts[1]))
    per_layer = max(0.0, (host_dec - experts[1] * per_expert) / layers)
    return per_layer * 1e6, per_expert * 1e6


def measure_cpu(ckpt: Path | None = None,
                served: "ServedInstances | None" = None) -> DeviceSpec:
    """Run the calibration and return the ``cpu`` device it measured, on the tiny
    checkpoint ``ckpt`` (a deployment's own, e.g. ``ensure_checkpoint(cfg.model)``; default
    a fresh one written to a temporary folder, a few seconds more). The served steps on
    ``served`` (up already, on ``ckpt``: ~5 s in all) or on instances brought up for them
    (~20-30 s in all).

    Raises:
        RuntimeError: the gloo pair did not finish within 120 s.
        TimeoutError, orchestrator.router.request.RequestError: a served calibration request did
            not complete within 60 s or failed.
        ray.exceptions.GetTimeoutError: a Ray call took over 60 s.
        orchestrator.deploy.rank_actors.BringUpError: the served instances did not come up.
    """
    if ckpt is None:
        import tempfile

        from orchestrator.tiny_model import write_tiny_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            return measure_cpu(write_tiny_checkpoint(Path(tmp) / "tiny"), served)
    from orchestrator.tiny_model import tiny_config_dict

    progress("memory bandwidth and compute of one core")
    rates = _local_rates()
    progress("a gloo pair's bandwidth and latency")
    rates.update(_gloo_rates())
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    raw = DeviceSpec(
        key="cpu", platform="cpu", name="cpu (measured on this machine)", memory_gb=ram,
        hbm_gb_s=rates["stream_gb_s"], bf16_tflops=rates["flops"] / 1e12,
        int8_tflops=rates["flops"] / 1e12, intra_domain_gb_s=rates["gloo_gb_s"],
        inter_domain_gb_s=rates["gloo_gb_s"], link_latency_us=rates["gloo_latency_us"],
        domain_ranks=os.cpu_count() or 1, layer_overhead_us=0.0)
    progress("the tiny model's prefill and decode steps")
    prefill_s, decode_s = _tiny_step_s(ckpt)
    progress("served steps on Ray (starts instances of the tiny model: the longest step)")
    call_us, socket_us, steps = _ray_figures(ckpt, served)
    per_layer, per_expert = _host_costs(raw, prefill_s, decode_s)
    latency = _collective_latency_us(int(tiny_config_dict()["num_hidden_layers"]), steps,
                                     call_us, raw.link_latency_us)
    serving_s = max(0.0, steps.tp1_gap_s - steps.bare_s)
    return replace(raw, layer_overhead_us=per_layer, expert_overhead_us=per_expert,
                   control_call_us=call_us, socket_call_us=socket_us,
                   link_latency_us=latency,
                   step_serving_us=serving_s * 1e6,
                   first_token_us=_first_token_us(steps.first_s, True, call_us, prefill_s,
                                                  serving_s),
                   pd_first_token_us=_first_token_us(steps.pd_first_s, False, call_us,
                                                     prefill_s, serving_s))


def _first_token_us(served_s: float, colocated: bool, call_us: float, prefill_s: float,
                    serving_s: float) -> float:
    """What a served time to first token (one request, ``served_s``) costs beyond what the
    model counts at one request: the calls in turn on its way
    (:func:`.host_terms.request_calls`), the bare prefill step and the serving cost per step."""
    from orchestrator.planner.host_terms import request_calls

    counted = request_calls(colocated) * call_us * 1e-6 + prefill_s + serving_s
    return max(0.0, served_s - counted) * 1e6


def cpu_device(recalibrate: bool = False) -> DeviceSpec:
    """The cached ``cpu`` device; measured (and cached) when absent, ``recalibrate`` or
    written by an older layout of :class:`.specs.DeviceSpec`, with progress lines on stderr (the
    plan itself goes to stdout)."""
    path = cache_path()
    if not recalibrate and path.exists():
        try:
            return DeviceSpec.from_dict("cpu", json.loads(path.read_text()))
        except TypeError:
            pass  # an older field layout: measure again
    _say(f"calibrating this machine's CPU (once, about 15-30 s; the figures are cached in "
         f"{path}, `orch plan --calibrate` measures again)")
    start = time.monotonic()
    spec = measure_cpu()
    _say(f"calibrated in {time.monotonic() - start:.1f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(spec), indent=1))
    return spec


def progress(step: str) -> None:
    """One calibration step under way, on stderr."""
    _say(f"calibrating: {step}")


def _say(line: str) -> None:
    print(f"orch plan: {line}", file=sys.stderr, flush=True)

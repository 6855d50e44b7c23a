"""The measured ``cpu`` device at the load of the moment: on a shared machine every figure
moves with what else runs.

The ``cpu`` device's figures (host dispatch per layer and per expert, the collective latency
a served TP step meets, the Ray call round trip, the serving cost per step, and the FLOP/s
and bandwidths) are all measured by processes competing for the same cores, so they slow
down together when other work takes them. The calibration records its reference, the tiny
model's batch-1 decode step in one process (``reference_step_us``); :func:`reference_step_s`
times the same step again (~0.3 s) and :func:`at_load` scales every time by the ratio (every
rate by its inverse). On a quiet machine the ratio is ~1; a comparison with a measurement on
a shared machine times the reference next to it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path

from orchestrator.planner.specs import DeviceSpec

CONTEXT = 64  # tokens the reference decode step attends to


def reference_step_s(ckpt: Path, steps: int = 15) -> float:
    """Median seconds of the tiny checkpoint ``ckpt``'s batch-1 decode step at context
    ``CONTEXT`` in this process (one torch thread, as a rank), after one warm-up step."""
    import torch

    from engine import envs
    from engine.runner import ModelRunner, SeqStep

    torch.set_num_threads(envs.ORCH_TORCH_THREADS.get())
    runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=16)
    table = tuple(range(8))
    runner.execute([SeqStep("p", tuple(range(1000, 1000 + CONTEXT)), 0, table)])
    runner.execute([SeqStep("p", (7,), CONTEXT, table)])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.execute([SeqStep("p", (7,), CONTEXT, table)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def at_load(spec: DeviceSpec, reference_s: float) -> DeviceSpec:
    """``spec`` with its times scaled by ``reference_s / spec.reference_step_us`` and its rates
    by the inverse (``spec`` itself when it has no reference: an accelerator).

    Raises:
        ValueError: ``reference_s`` is not > 0.
    """
    if reference_s <= 0:
        raise ValueError(f"reference step {reference_s} s: must be > 0")
    if spec.reference_step_us <= 0:
        return spec
    f = reference_s * 1e6 / spec.reference_step_us
    return replace(spec, hbm_gb_s=spec.hbm_gb_s / f, bf16_tflops=spec.bf16_tflops / f,
                   int8_tflops=spec.int8_tflops / f, intra_node_gb_s=spec.intra_node_gb_s / f,
                   inter_node_gb_s=spec.inter_node_gb_s / f,
                   layer_overhead_us=spec.layer_overhead_us * f,
                   expert_overhead_us=spec.expert_overhead_us * f,
                   link_latency_us=spec.link_latency_us * f,
                   control_call_us=spec.control_call_us * f,
                   step_serving_us=spec.step_serving_us * f,
                   reference_step_us=reference_s * 1e6)

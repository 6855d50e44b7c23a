"""The measured ``cpu`` device at the load of the moment: on a shared machine every figure
moves with what else runs.

The ``cpu`` device's figures (host dispatch per layer and per expert, the collective latency
a served TP step meets, the Ray call round trip, the serving cost per step, and the FLOP/s
and bandwidths) are all measured by processes competing for the same cores, so they slow
down together when other work takes them. The calibration records its reference, the served
tp-1 step of the tiny model (``reference_step_us``: a request's mean token gap, rank actors
and event path as served); :class:`Reference` keeps such an instance up and times the same
gap again (~0.4 s), and :func:`at_load` scales every time of the device by the ratio (every
rate by its inverse). A served step, not a step in one process: under load the hand-offs
between the processes (Ray calls, events, the collectives of a TP pair) slow down far more
than one process's own work. On a quiet machine the ratio is ~1; a comparison with a
measurement on a shared machine times the reference next to it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from orchestrator.planner.specs import DeviceSpec


class Reference:
    """A tp-1 tiny instance (the calibration's) kept up on the Ray this process runs, to
    time the reference step next to a measurement; a context manager (kills its actor).

    Raises:
        ray.exceptions.GetTimeoutError: its bring-up took over 60 s.
    """

    def __init__(self, ckpt: Path) -> None:
        from orchestrator.planner.calibrate_serving import start_instance

        self._ranks = start_instance(ckpt, 1)
        self._served = 0

    def step_s(self) -> float:
        """The served step now: one request's mean token gap, seconds.

        Raises:
            TimeoutError, RuntimeError: the request did not complete.
        """
        from orchestrator.planner.calibrate_serving import served_request_s

        self._served += 1
        return served_request_s(self._ranks[0], f"reference-{self._served}")[1]

    def close(self) -> None:
        import ray

        for rank in self._ranks:
            ray.kill(rank)

    def __enter__(self) -> "Reference":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
                   first_token_us=spec.first_token_us * f,
                   reference_step_us=reference_s * 1e6)

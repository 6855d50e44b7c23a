"""Device descriptions and efficiency factors, read from ``devices.yaml`` (one data file).

Each figure there has its public source in a comment; ``cpu`` is measured instead
(:mod:`orchestrator.planner.calibrate`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import yaml

DEVICES_FILE = Path(__file__).with_name("devices.yaml")


@dataclass(frozen=True)
class DeviceSpec:
    """What one rank (one die / GPU / CPU slot) offers.

    Attributes:
        key: entry name ("a3", "h100", "cpu").
        platform: ``cluster.device`` it serves ("npu", "cuda", "cpu").
        name: words for reports.
        memory_gb: memory per rank, GB (10^9 bytes).
        hbm_gb_s: memory bandwidth, GB/s.
        bf16_tflops, int8_tflops: dense peak, 10^12 FLOP/s (cpu: measured at the model dtype).
        intra_node_gb_s, inter_node_gb_s: unidirectional link bandwidth per rank, GB/s.
        link_latency_us: fixed cost of one collective or transfer message, us.
        ranks_per_node: ranks that share the intra-node links.
        layer_overhead_us: host dispatch per layer per step not hidden by the device, us.
        expert_overhead_us: host dispatch per routed expert a step runs on the rank, per MoE
            layer, us (0 where one grouped kernel runs every expert).
        control_call_us: one Ray actor call round trip, us: the leader's step call to its TP
            followers (every step with tp > 1) and the router's calls per request.
        step_serving_us: the serving layer's cost per leader step on top of the engine step
            (scheduler, sampler, token events, the router's poll of them), us; measured on
            cpu, 0 (not estimated) for the accelerators.
        first_token_us: what a request's first token costs on its way out beyond the
            serving cost per step (the event path not overlapped with a next step: the rank's
            loop waking for the new request, the poll returning the lone first event), us,
            once per request; measured on cpu, 0 (not estimated) for the accelerators.
        pd_first_token_us: the same for a disaggregated request (from the decode
            reservation to the prefill's first event: beyond the three calls, the
            reservation's own work and the prefill rank's KV sends, which start right after
            its step, competing with the first token's way out), us, once per request;
            measured on cpu, 0 (not estimated) for the accelerators.
    """

    key: str
    platform: str
    name: str
    memory_gb: float
    hbm_gb_s: float
    bf16_tflops: float
    int8_tflops: float
    intra_node_gb_s: float
    inter_node_gb_s: float
    link_latency_us: float
    ranks_per_node: int
    layer_overhead_us: float
    expert_overhead_us: float = 0.0
    control_call_us: float = 0.0
    step_serving_us: float = 0.0
    first_token_us: float = 0.0
    pd_first_token_us: float = 0.0


@dataclass(frozen=True)
class Efficiency:
    """Achieved / peak factors (docs/planner.md: which were fitted, to what)."""

    compute: float
    hbm: float
    link: float


@lru_cache(maxsize=1)
def _raw() -> dict:
    with open(DEVICES_FILE) as f:
        return yaml.safe_load(f)


def device_table() -> dict[str, DeviceSpec]:
    """Every device of ``devices.yaml`` by key, in file order."""
    names = {f.name for f in fields(DeviceSpec)} - {"key"}
    return {key: DeviceSpec(key=key, **{k: v for k, v in entry.items() if k in names})
            for key, entry in _raw()["devices"].items()}


def efficiency(device: DeviceSpec) -> Efficiency:
    """The efficiency factors for ``device``: 1.0 each for the measured ``cpu`` (its figures
    are achieved rates already), else the file's."""
    if device.platform == "cpu":
        return Efficiency(1.0, 1.0, 1.0)
    return Efficiency(**_raw()["efficiency"])


def default_device(platform: str) -> DeviceSpec:
    """The first ``devices.yaml`` entry of ``platform`` ("npu": a3, "cuda": h100).

    Raises:
        ValueError: no entry for ``platform`` (names the file to extend).
    """
    for spec in device_table().values():
        if spec.platform == platform:
            return spec
    raise ValueError(f"no device of platform {platform!r} in {DEVICES_FILE}: add one")


def named_device(key: str) -> DeviceSpec:
    """The entry ``key`` of ``devices.yaml`` (``cpu`` is :func:`.calibrate.cpu_device`).

    Raises:
        ValueError: unknown key (lists the known ones).
    """
    table = device_table()
    if key not in table:
        raise ValueError(f"unknown device {key!r}: one of {', '.join(table)} or cpu")
    return table[key]

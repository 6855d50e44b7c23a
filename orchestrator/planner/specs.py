"""Device descriptions, per-kernel efficiencies and EP all-to-all figures, read from
``devices.yaml`` (one data file).

Each figure there has its public source in a comment; ``cpu`` is measured instead
(:mod:`orchestrator.planner.calibrate`): its rates are achieved ones already, so its kernel
efficiencies are 1.0 and it has no all-to-all table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

import yaml

DEVICES_FILE = Path(__file__).with_name("devices.yaml")


@dataclass(frozen=True)
class Kernels:
    """Achieved / peak of each kernel class (devices.yaml ``kernel_sets``: sources there).

    Attributes:
        gemm_fp8, gemm_bf16, gemm_int8: large-M GEMMs at that precision's dense peak.
        gemm_masked: decode's grouped expert GEMMs (a few hundred rows per expert), as a
            share of the large-M ratio.
        weights_hbm: weight streaming of small-M GEMMs, of ``hbm_gb_s``.
        attn_prefill, attn_decode: attention FLOPs, of the bf16 peak (``attn_prefill``:
            prefill attention in absorbed / sparse form, and any prefill without a causal
            table).
        attn_prefill_causal: causal prefill attention in MHA form (dense MLA prefill: per-head
            keys and values) by sequence length: (length, share of the bf16 peak) pairs,
            ascending; a length between two entries interpolates in log2(length), outside
            them takes the nearest; empty: ``attn_prefill`` at every length.
        attn_decode_hbm: KV reads of decode attention, of ``hbm_gb_s``.
        link: collectives (TP all-reduce, logits gather, KV transfer), of the link peak.
        elementwise_hbm: the kernels between the GEMMs (norms, RoPE, SiLU, quantization,
            combine sums), of ``hbm_gb_s``; 0: not modelled apart (cpu: inside the measured
            host dispatch).
    """

    gemm_fp8: float = 1.0
    gemm_bf16: float = 1.0
    gemm_int8: float = 1.0
    gemm_masked: float = 1.0
    weights_hbm: float = 1.0
    attn_prefill: float = 1.0
    attn_decode: float = 1.0
    attn_decode_hbm: float = 1.0
    link: float = 1.0
    elementwise_hbm: float = 0.0
    attn_prefill_causal: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        # NOTE: devices.yaml gives the table as a mapping, a cached cpu device as lists
        raw = self.attn_prefill_causal
        pairs = raw.items() if isinstance(raw, dict) else raw
        object.__setattr__(self, "attn_prefill_causal",
                           tuple(sorted((int(n), float(e)) for n, e in pairs)))

    def causal_prefill(self, length: float) -> float:
        """Share of the bf16 peak of causal MHA-form prefill attention over sequences of
        ``length`` tokens (:attr:`attn_prefill_causal`; ``attn_prefill`` without a table)."""
        return log2_interp(self.attn_prefill_causal, length) if self.attn_prefill_causal \
            else self.attn_prefill


def log2_interp(pts: tuple, x: float):
    """The value at ``x`` of ``pts`` ((x, value) pairs, ascending x; a value is a number or
    a tuple of numbers), linear in log2(x) between two entries, the nearest entry's outside
    them."""
    if x <= pts[0][0]:
        return pts[0][1]
    for (lo, a), (hi, b) in zip(pts, pts[1:]):
        if x <= hi:
            t = (math.log2(x) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            if isinstance(a, tuple):
                return tuple(u + t * (v - u) for u, v in zip(a, b))
            return a + t * (b - a)
    return pts[-1][1]


@dataclass(frozen=True)
class AllToAll:
    """Achieved EP dispatch / combine bandwidth per rank, GB/s (devices.yaml
    ``alltoall_sets``).

    Attributes:
        normal_intra, normal_inter: (dispatch, combine) of the prefill ("normal") kernels
            inside one scale-up domain / across domains (bytes counted once per destination
            domain of a token).
        low_latency: EP size -> (dispatch, combine) of the decode kernels (bytes counted
            once per routed expert copy); sizes between two entries interpolate in log2(EP),
            outside them take the nearest.
        normal_sm_share: share of the compute units the normal kernels hold while they run
            (computation overlapped with them runs that much slower).
    """

    normal_intra: tuple[float, float]
    normal_inter: tuple[float, float]
    low_latency: tuple[tuple[int, tuple[float, float]], ...]
    normal_sm_share: float = 0.0

    def low_latency_gb_s(self, ep: int) -> tuple[float, float]:
        """(dispatch, combine) GB/s of the decode kernels at EP size ``ep``."""
        return log2_interp(self.low_latency, ep)

    @classmethod
    def from_dict(cls, raw: dict) -> "AllToAll":
        ll = raw["low_latency"]
        pairs = ll.items() if isinstance(ll, dict) else ll
        return cls(tuple(raw["normal_intra"]), tuple(raw["normal_inter"]),
                   tuple(sorted((int(k), tuple(v)) for k, v in pairs)),
                   raw.get("normal_sm_share", 0.0))


@dataclass(frozen=True)
class DeviceSpec:
    """What one rank (one die / GPU / CPU slot) offers.

    Attributes:
        key: entry name ("a3", "h800", "cpu").
        platform: ``cluster.device`` it serves ("npu", "cuda", "cpu").
        name: words for reports.
        memory_gb: memory per rank, GB (10^9 bytes).
        hbm_gb_s: memory bandwidth, GB/s.
        bf16_tflops, int8_tflops: dense peak, 10^12 FLOP/s (cpu: measured at the model dtype).
        intra_domain_gb_s, inter_domain_gb_s: unidirectional link bandwidth per rank inside
            one scale-up domain and beyond it, GB/s.
        link_latency_us: fixed cost of one collective or transfer message, us.
        domain_ranks: ranks of one scale-up domain (8 for an HGX server, 768 dies for a
            CloudMatrix384 supernode).
        layer_overhead_us: host dispatch per layer per step not hidden by the device, us.
        fp8_tflops: dense FP8 peak (0: none; 1-byte linears then run at the int8 peak).
        kernels: per-kernel efficiencies (1.0 each: the measured cpu).
        alltoall: the EP library's figures (None: the plain link model, cpu).
        expert_overhead_us: host dispatch per routed expert a step runs on the rank, per MoE
            layer, us (0 where one grouped kernel runs every expert).
        control_call_us: one Ray actor call round trip, us: the leader's step call to its TP
            followers (every step with tp > 1) and the router's calls per request.
        step_serving_us: the serving layer's cost per leader step on top of the engine step
            (scheduler, sampler, token events, the router's poll of them), us; measured on
            cpu, 0 (not estimated) for the accelerators.
        first_token_us: what a request's first token costs on its way out beyond the
            serving cost per step, us, once per request; measured on cpu, 0 (not estimated)
            for the accelerators.
        pd_first_token_us: the same for a disaggregated request, us, once per request;
            measured on cpu, 0 (not estimated) for the accelerators.
        socket_call_us: one router call to a leader over its call socket
            (``router.leader_calls: socket``), round trip, us; measured on cpu, 0 (not
            estimated: ``control_call_us`` stands in) for the accelerators.
    """

    key: str
    platform: str
    name: str
    memory_gb: float
    hbm_gb_s: float
    bf16_tflops: float
    int8_tflops: float
    intra_domain_gb_s: float
    inter_domain_gb_s: float
    link_latency_us: float
    domain_ranks: int
    layer_overhead_us: float
    fp8_tflops: float = 0.0
    kernels: Kernels = field(default_factory=Kernels)
    alltoall: AllToAll | None = None
    expert_overhead_us: float = 0.0
    control_call_us: float = 0.0
    step_serving_us: float = 0.0
    first_token_us: float = 0.0
    pd_first_token_us: float = 0.0
    socket_call_us: float = 0.0

    @classmethod
    def from_dict(cls, key: str, raw: dict) -> "DeviceSpec":
        """An entry of devices.yaml (or a cached cpu device); unknown keys are ignored.

        Raises:
            TypeError: a required field is missing (e.g. a cache from an older layout).
        """
        names = {f.name for f in fields(cls)} - {"key"}
        values = {k: v for k, v in raw.items() if k in names}
        if isinstance(values.get("kernels"), dict):
            values["kernels"] = Kernels(**values["kernels"])
        if isinstance(values.get("alltoall"), dict):
            values["alltoall"] = AllToAll.from_dict(values["alltoall"])
        return cls(key=key, **values)


@lru_cache(maxsize=1)
def _raw() -> dict:
    with open(DEVICES_FILE) as f:
        return yaml.safe_load(f)


def device_table() -> dict[str, DeviceSpec]:
    """Every device of ``devices.yaml`` by key, in file order."""
    return {key: DeviceSpec.from_dict(key, entry) for key, entry in _raw()["devices"].items()}


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

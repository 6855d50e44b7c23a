"""The one place that decides device type and torch.distributed backend.

Detection order: Ascend NPU (``torch_npu`` importable and a device present), CUDA, CPU;
``ORCH_DEVICE`` ("npu", "cuda", "cpu") overrides it. ``torch_npu`` is imported lazily. The
orchestrator asks here too (:func:`platform_for`), so control plane and ranks agree.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from engine import envs

DIST_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
DEVICE_FOR_BACKEND = {backend: device for device, backend in DIST_BACKENDS.items()}
AUTO = "auto"


@dataclass(frozen=True)
class Platform:
    """Device type and matching collective backend.

    Attributes:
        device_type: "npu", "cuda" or "cpu" (the kernel registry is keyed by it).
        dist_backend: "hccl", "nccl" or "gloo".
    """

    device_type: str
    dist_backend: str

    def device(self, rank: int = 0) -> torch.device:
        """The device of TP rank ``rank``: visible accelerator ``rank % visible`` (so a Ray
        actor that sees exactly one device uses it), or the CPU."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        visible = getattr(torch, self.device_type).device_count()
        return torch.device(self.device_type, rank % max(visible, 1))


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def detect_platform(device_type: str | None = None) -> Platform:
    """Platform for ``device_type``, or for ``$ORCH_DEVICE``, or detected.

    Raises:
        ValueError: unknown device type (message lists the allowed ones).
        RuntimeError: "npu" asked for but torch_npu cannot be imported.
    """
    device_type = device_type or envs.ORCH_DEVICE.get() or None
    if device_type is None:
        if _npu_available():
            device_type = "npu"
        elif torch.cuda.is_available():
            device_type = "cuda"
        else:
            device_type = "cpu"
    if device_type not in DIST_BACKENDS:
        raise ValueError(f"device type {device_type!r} is not one of {sorted(DIST_BACKENDS)}; "
                         "set ORCH_DEVICE to one of them or leave it unset to auto-detect")
    if device_type == "npu":
        try:
            importlib.import_module("torch_npu")  # registers the "npu" device with torch
        except ImportError as exc:
            raise RuntimeError("device 'npu' needs torch_npu: pip install orch[npu]") from exc
    return Platform(device_type=device_type, dist_backend=DIST_BACKENDS[device_type])


def platform_for(device: str = AUTO, backend: str = AUTO,
                 keys: tuple[str, str] = ("device", "backend")) -> Platform:
    """The platform of a deployment asking for ``device`` and ``backend`` (``"auto"``: not
    set): the device when set, else the backend's device, else :func:`detect_platform`. A set
    one is a table lookup, nothing probed (a CPU machine can plan an NPU layout). ``keys``:
    the two settings' names for the error, e.g. ``("cluster.device", "kv_transfer.backend")``.

    Raises:
        ValueError: a device or backend not in the table, or a backend that does not go with
            the device (the message says which backend to use).
    """
    device_key, backend_key = keys
    if device != AUTO and device not in DIST_BACKENDS:
        raise ValueError(f"{device_key} '{device}' is not one of {sorted(DIST_BACKENDS)} "
                         "(or 'auto')")
    if backend != AUTO and backend not in DEVICE_FOR_BACKEND:
        raise ValueError(f"{backend_key} '{backend}' is not one of "
                         f"{sorted(DEVICE_FOR_BACKEND)} (or 'auto')")
    if device != AUTO and backend not in (AUTO, DIST_BACKENDS[device]):
        raise ValueError(f"{backend_key} '{backend}' does not work with {device_key} "
                         f"'{device}': use backend '{DIST_BACKENDS[device]}' (or 'auto') for "
                         f"{device}")
    if device == AUTO and backend == AUTO:
        return detect_platform()
    device = device if device != AUTO else DEVICE_FOR_BACKEND[backend]
    return Platform(device_type=device, dist_backend=DIST_BACKENDS[device])

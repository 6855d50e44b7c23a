"""Memory of one device, per device type: what the memory plan checks each rank against.

Figures are vendors' capacities in GB (10^9 bytes) from ``orchestrator/planner/devices.yaml``
(defaults: npu = Atlas A3 die, cuda = H100 80GB); ``cluster.device_memory_gb`` overrides them.
NOTE: the runtime keeps some memory, so aim for a few GB of headroom under the figure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from orchestrator.planner.specs import default_device

GB = 10**9


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device offers the ranks on it, and where the figure came from.

    Attributes:
        bytes: capacity, bytes.
        source: a few words ("npu default: Atlas A3 die", "cluster.device_memory_gb", ...).
        shared: True when all ranks share it (cpu: one machine's RAM), so the plan checks
            the sum of every rank instead of each rank.
    """

    bytes: int
    source: str
    shared: bool


def device_memory(device: str, override_gb: float | None) -> DeviceMemory:
    """The memory a rank of ``device`` ("cpu", "cuda", "npu") is checked against.

    ``override_gb`` (``cluster.device_memory_gb``) wins; else the platform's default entry of
    ``devices.yaml``; on cpu the machine's physical RAM, shared by every rank.

    Raises:
        ValueError: an unknown device with no override (names the key to set).
    """
    shared = device == "cpu"
    if override_gb is not None:
        return DeviceMemory(int(override_gb * GB), "cluster.device_memory_gb", shared)
    if shared:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceMemory(ram, "cpu: this machine's RAM, shared by all ranks", shared)
    try:
        spec = default_device(device)
    except ValueError:
        raise ValueError(f"no memory figure for device {device!r}: set "
                         "cluster.device_memory_gb") from None
    return DeviceMemory(int(spec.memory_gb * GB), f"{device} default: {spec.name}", False)

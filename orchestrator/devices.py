"""Memory of one device, per device type: what the memory plan checks each rank against.

Figures are the vendors' published capacities in GB (10^9 bytes). The physical HBM is a
little larger in bytes (GiB stacks) and the runtime keeps some of it, so a plan that fits the
figure with a few GB of headroom is the aim. ``cluster.device_memory_gb`` overrides them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GB = 10**9

DEVICE_MEMORY_GB: dict[str, tuple[float, str]] = {
    # Huawei Atlas A3 (Ascend 910C): two dies per chip, 128 GB HBM per chip = 64 GB per die;
    # one rank = one die. Source: "Serving Large Language Models on Huawei CloudMatrix384",
    # arXiv:2506.12708, section 3 (Ascend 910C chip).
    "npu": (64.0, "Atlas A3 die"),
    # NVIDIA H100 SXM / A100 80GB: 80 GB HBM. Source: nvidia.com/en-us/data-center/h100/
    # ("GPU Memory 80GB") and nvidia.com/en-us/data-center/a100/.
    "cuda": (80.0, "80 GB GPU (H100 / A100 80GB)"),
}


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

    ``override_gb`` (``cluster.device_memory_gb``) wins; else the table above; on cpu the
    machine's physical RAM (``os.sysconf``), shared by every rank.

    Raises:
        ValueError: an unknown device with no override (names the key to set).
    """
    shared = device == "cpu"
    if override_gb is not None:
        return DeviceMemory(int(override_gb * GB), "cluster.device_memory_gb", shared)
    if shared:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return DeviceMemory(ram, "cpu: this machine's RAM, shared by all ranks", shared)
    if device not in DEVICE_MEMORY_GB:
        raise ValueError(f"no memory figure for device {device!r}: set "
                         "cluster.device_memory_gb")
    gb, name = DEVICE_MEMORY_GB[device]
    return DeviceMemory(int(gb * GB), f"{device} default: {name}", False)

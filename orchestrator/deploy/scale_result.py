"""What a scaling call returns or raises, and what it needs of the cluster
(orchestrator/deploy/scaling.py, orchestrator/deploy/ep_resize.py; docs/scaling.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class ScaleError(ValueError):
    """A scaling request that cannot be done; the message says why and what to do."""


class Scalable(Protocol):
    """What the scaler needs of the cluster (:class:`~orchestrator.deploy.cluster.Cluster`)."""

    def add_instance(self, inst: Any, timeout_s: float) -> Any:
        """Blocking; the started instance (``.leader``: its leader handle)."""

    def remove_instance(self, name: str) -> None:
        """Blocking; drain + shutdown its leader, kill its ranks, remove its group."""

    def add_group(self, insts: list[Any], timeout_s: float) -> list[Any]:
        """Blocking; a whole new EP group (each: ``.leader``), in ``insts`` order."""

    def remove_group(self, names: list[str]) -> None:
        """Blocking; stop those instances together (an old EP group)."""


@dataclass(frozen=True)
class ScaleResult:
    """What one scaling call did: instances added and removed (names), requests moved."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    moved_requests: int = 0


def missing_resources(need: dict[str, float], free: dict[str, float]) -> list[str]:
    """``"CPU: needs 1, 0.5 free"`` for each resource ``need`` asks more of than ``free``."""
    return [f"{key}: needs {amount:g}, {free.get(key, 0.0):g} free"
            for key, amount in sorted(need.items()) if amount > free.get(key, 0.0) + 1e-9]

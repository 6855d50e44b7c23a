"""Instance-choice policies, chosen by name through a registry (`router.policy`).

A policy orders the HEALTHY instances of a role for a request, best first (empty: the request
is refused UNAVAILABLE), and is told when the request's load ends. Load is tokens: a prefill
instance carries the prompts it has not finished; a decode (or colocated) instance
``prompt + max_tokens`` of each request it holds (the KV slots it may need).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable


class Policy(ABC):
    """Chooses among the instances of one role. Called only from the router's event loop.

    ``instances``: names, e.g. ["decode-0", "decode-1"]; ``healthy``: may new requests go
    to this one (``HealthMonitor.is_healthy``; default: all).
    """

    def __init__(self, instances: list[str],
                 healthy: Callable[[str], bool] = lambda name: True) -> None:
        if not instances:
            raise ValueError("a policy needs at least one instance")
        self.instances = list(instances)
        self.healthy = healthy
        self.outstanding = {name: 0 for name in instances}  # tokens in flight per instance

    def order(self) -> list[str]:
        """The healthy instances, best first (the router tries them in this order); empty
        when none is healthy."""
        return [name for name in self.preference() if self.healthy(name)]

    @abstractmethod
    def preference(self) -> list[str]:
        """All instances, best first, health aside."""

    def acquire(self, name: str, tokens: int) -> None:
        """A request with ``tokens`` of load was placed on ``name``."""
        self.outstanding[name] += tokens

    def release(self, name: str, tokens: int) -> None:
        """That load left ``name`` (finished, aborted or failed); called exactly once."""
        self.outstanding[name] -= tokens

    def add(self, name: str) -> None:
        """A new instance of the role (live scaling): chosen from now on when healthy."""
        if name not in self.outstanding:
            self.instances.append(name)
            self.outstanding[name] = 0

    def remove(self, name: str) -> None:
        """``name`` left the role (drained: no load left on it).

        Raises:
            ValueError: it still carries load, or it is the role's last instance.
        """
        if self.outstanding.get(name, 0):
            raise ValueError(f"{name} still carries {self.outstanding[name]} tokens of load")
        if self.instances == [name]:
            raise ValueError(f"{name} is the last instance of its role")
        self.instances.remove(name)
        del self.outstanding[name]


class RoundRobin(Policy):
    """Each call starts one instance further along; ignores load."""

    def __init__(self, instances: list[str],
                 healthy: Callable[[str], bool] = lambda name: True) -> None:
        super().__init__(instances, healthy)
        self._next = 0

    def preference(self) -> list[str]:
        start = self._next
        self._next = (self._next + 1) % len(self.instances)
        return self.instances[start:] + self.instances[:start]


class LeastOutstandingTokens(Policy):
    """Fewest tokens in flight first; ties rotate (each call starts them one instance further
    along), so idle instances share short requests instead of the first one taking them all."""

    def __init__(self, instances: list[str],
                 healthy: Callable[[str], bool] = lambda name: True) -> None:
        super().__init__(instances, healthy)
        self._calls = 0

    def preference(self) -> list[str]:
        n, start = len(self.instances), self._calls % len(self.instances)
        self._calls += 1
        return sorted(self.instances, key=lambda name: (
            self.outstanding[name], (self.instances.index(name) - start) % n))


POLICIES: dict[str, Callable[[list[str], Callable[[str], bool]], Policy]] = {
    "round_robin": RoundRobin,
    "least_outstanding_tokens": LeastOutstandingTokens,
}


def make_policy(name: str, instances: list[str],
                healthy: Callable[[str], bool] = lambda name: True) -> Policy:
    """Build the policy registered as ``name`` over ``instances`` (``healthy``: see Policy).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: use one of {sorted(POLICIES)}")
    return POLICIES[name](instances, healthy)

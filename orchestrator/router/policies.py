"""Instance-choice policies, chosen by name through a registry (`router.policy`).

A policy orders the HEALTHY instances of a role for a request, best first (empty: the request
is refused UNAVAILABLE), and is told when the request's load ends. Load is tokens: a prefill
instance carries the prompts it has not finished; a decode (or colocated) instance
``prompt + max_tokens`` of each request it holds (the KV slots it may need). ``kv_aware`` also
weighs the prompt's prefix each instance holds in its prefix cache, and charges a prefill or
colocated instance only the tokens it computes: those less that prefix (docs/prefix_cache.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Callable

from orchestrator.router.kv_index import KVIndex


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

    def order(self, prompt_token_ids: Sequence[int] = ()) -> list[str]:
        """The healthy instances, best first (the router tries them in this order) for a
        request of ``prompt_token_ids`` (only :class:`KVAware` reads it); empty when none is
        healthy."""
        return [name for name in self.preference_for(prompt_token_ids) if self.healthy(name)]

    def preference_for(self, prompt_token_ids: Sequence[int]) -> list[str]:
        """All instances, best first for this prompt, health aside (default: the prompt
        does not matter)."""
        return self.preference()

    @abstractmethod
    def preference(self) -> list[str]:
        """All instances, best first, health aside."""

    def load_for(self, name: str, tokens: int, prompt_token_ids: Sequence[int] = ()) -> int:
        """The load a request of ``tokens`` tokens (its prompt ``prompt_token_ids``) puts on
        ``name``, to :meth:`acquire` now and :meth:`release` as the same number (default:
        ``tokens``; only :class:`KVAware` reads the prompt)."""
        return tokens

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


class KVAware(LeastOutstandingTokens):
    """Prefix-cache aware (NVIDIA Dynamo's KV router cost): each instance costs
    ``overlap_weight x (prompt tokens it would compute) + outstanding tokens``, lowest first,
    where the tokens it need not compute are the prompt's leading full blocks it holds in its
    prefix cache, as its KV events reported them (:class:`KVIndex`). Ties (no cached prefix
    anywhere) fall back to least outstanding tokens, rotating.

    Outstanding tokens count, of each request placed with its prompt (:meth:`load_for`), only
    what the instance computes: its tokens less the prefix that instance held then (Dynamo's
    router counts a request's prefill as its input less the overlap). A whole prompt would
    send a conversation's next turn away from its cache while its instance computes other,
    mostly cached, turns (docs/prefix_cache.md, Bounded caches).

    Args:
        index: the router's view of every instance's cache (fed by the event pump).
        overlap_weight: tokens of load one cached prompt token is worth (1.0: a cached token
            saves as much as one token of queued work costs).
    """

    def __init__(self, instances: list[str],
                 healthy: Callable[[str], bool] = lambda name: True,
                 index: KVIndex | None = None, overlap_weight: float = 1.0) -> None:
        super().__init__(instances, healthy)
        self.index = index if index is not None else KVIndex()
        self.overlap_weight = overlap_weight

    def preference_for(self, prompt_token_ids: Sequence[int]) -> list[str]:
        if not prompt_token_ids:
            return self.preference()
        return self.preference_given(
            self.index.cached_tokens(self.instances, prompt_token_ids), len(prompt_token_ids))

    def preference_given(self, cached: dict[str, int], num_prompt_tokens: int) -> list[str]:
        """All instances, best first, health aside, for a prompt of ``num_prompt_tokens`` of
        which instance ``name`` holds the leading ``cached[name]`` tokens (the cost above).
        :meth:`preference_for` calls it with the index's view; an offline replay calls it
        with its caches' own state (benchmarks/prefix_cache_bounded.py)."""
        base = self.preference()  # NOTE: least outstanding, rotating: the tie order
        return sorted(base, key=lambda name: (
            self.overlap_weight * self.load_given(cached[name], num_prompt_tokens) +
            self.outstanding[name]))

    def load_for(self, name: str, tokens: int, prompt_token_ids: Sequence[int] = ()) -> int:
        """``tokens`` less the leading prompt tokens ``name`` holds now (index's view);
        ``tokens`` when no prompt is given."""
        if not prompt_token_ids:
            return tokens
        return self.load_given(self.index.cached_tokens([name], prompt_token_ids)[name], tokens)

    @staticmethod
    def load_given(cached: int, tokens: int) -> int:
        """Tokens an instance computes of a request of ``tokens`` tokens whose leading
        ``cached`` prompt tokens it holds (``cached`` <= the prompt <= ``tokens``), the cost's
        and the load's one formula; the offline replay calls it with its caches' state."""
        return tokens - cached


POLICIES: dict[str, Callable[..., Policy]] = {
    "round_robin": RoundRobin,
    "least_outstanding_tokens": LeastOutstandingTokens,
    "kv_aware": KVAware,
}


def make_policy(name: str, instances: list[str],
                healthy: Callable[[str], bool] = lambda name: True,
                index: KVIndex | None = None) -> Policy:
    """Build the policy registered as ``name`` over ``instances`` (``healthy``: see Policy;
    ``index``: the router's :class:`KVIndex`, read by ``kv_aware``).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: use one of {sorted(POLICIES)}")
    if name == "kv_aware":
        return KVAware(instances, healthy, index)
    return POLICIES[name](instances, healthy)

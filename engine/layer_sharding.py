"""Layer sharding of attention weights over a context-parallel (CP) group.

Under CP every rank runs all heads, so attention weights would be replicated. With
``layer_sharding`` (attention linears, e.g. ``("q_b_proj", "o_proj")``) layer ``i``'s weight is
stored ONLY on CP rank ``i % cp`` (:func:`owner_of`); the others build an unallocated
placeholder (:func:`unowned_params`). :class:`LayerPrefetcher` broadcasts layer ``i + 1``
asynchronously into one of ``pool_size`` reusable buffer sets while layer ``i`` computes;
``stats.wait_s`` is the broadcast time compute did not hide.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from engine.layout import linear_shape
from engine.model_config import ModelConfig
from engine.parallel import CPGroup

SHARDABLE: tuple[str, ...] = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                              "kv_b_proj", "o_proj")
"""The attention linears ``layer_sharding`` may name."""


def owner_of(layer_idx: int, cp_size: int) -> int:
    """The CP rank that stores layer ``layer_idx``'s sharded weights."""
    return layer_idx % cp_size


def check_layer_sharding(names: tuple[str, ...], config: ModelConfig) -> None:
    """Raise ValueError, naming the fix, unless every name is one of :data:`SHARDABLE` that
    ``config``'s attention has (``q_proj`` without ``q_lora_rank``, ``q_a_proj`` /
    ``q_b_proj`` with it)."""
    unknown = [n for n in names if n not in SHARDABLE]
    if unknown:
        raise ValueError(f"layer_sharding names {unknown}; it takes attention linears of "
                         f"{list(SHARDABLE)}")
    absent = ("q_a_proj", "q_b_proj") if config.q_lora_rank is None else ("q_proj",)
    if any(n in absent for n in names):
        raise ValueError(f"layer_sharding names {[n for n in names if n in absent]}, which "
                         f"this model (q_lora_rank={config.q_lora_rank}) does not have; "
                         "drop them from layer_sharding")


def check_sharded_modules(names: tuple[str, ...], layers: nn.ModuleList) -> None:
    """Raise ValueError, naming the fix, unless every name is a plain (unquantized)
    ``nn.Linear`` of the built model's attention."""
    for name in names:
        module = getattr(layers[0].self_attn, name)
        if type(module) is not nn.Linear:
            raise ValueError(f"layer_sharding: {name} is quantized in this checkpoint "
                             f"({type(module).__name__}); drop it from layer_sharding")


def unowned_params(num_layers: int, names: tuple[str, ...], cp: CPGroup) -> frozenset[str]:
    """Parameter names of the sharded weights of the layers another CP rank owns: the model
    builds them empty (``build_model(empty=...)``) and the loader never reads them."""
    return frozenset(f"model.layers.{i}.self_attn.{name}.weight" for i in range(num_layers)
                     if owner_of(i, cp.size) != cp.rank for name in names)


def layer_sharding_bytes(config: ModelConfig, names: tuple[str, ...], cp_size: int,
                         cp_rank: int, bytes_per_param: int, pool_size: int = 2) -> tuple[int, int]:
    """For the memory plan: ``(stored, pool)`` bytes of the ``names`` weights on CP rank
    ``cp_rank``: those of the layers it owns, and the :class:`LayerPrefetcher`'s receive
    buffers (``pool_size`` layers' worth; 0 at ``cp_size == 1``)."""
    per_layer = sum(math.prod(linear_shape(config, n)) for n in names) * bytes_per_param
    owned = sum(owner_of(i, cp_size) == cp_rank for i in range(config.num_hidden_layers))
    return owned * per_layer, (pool_size * per_layer if cp_size > 1 and names else 0)


@dataclass
class PrefetchStats:
    """``wait_s`` seconds blocked on broadcasts out of ``forward_s`` seconds of forwards
    (``begin`` to last layer), ``layers`` brought in, ``bytes_received``."""

    wait_s: float = 0.0
    forward_s: float = 0.0
    layers: int = 0
    bytes_received: int = 0


class LayerPrefetcher:
    """Broadcasts layer ``i + 1``'s sharded weights while layer ``i`` computes.

    NOTE: every CP rank calls :meth:`begin`, then :meth:`before_layer` / :meth:`after_layer`
    for every layer in order (the broadcasts are collectives). Waits are bounded by the
    weight group's timeout (``RuntimeError``).

    Raises:
        ValueError: ``pool_size < 2``.
    """

    def __init__(self, layers: nn.ModuleList, names: tuple[str, ...], cp: CPGroup,
                 dtype: torch.dtype, device: torch.device, pool_size: int = 2) -> None:
        if pool_size < 2:
            raise ValueError(f"pool_size={pool_size}: layer i+1's broadcast needs a buffer "
                             "set other than layer i's; use at least 2")
        self._cp, self._n = cp, len(layers)
        self._modules = [[getattr(layer.self_attn, n) for n in names] for layer in layers]
        shapes = [(m.out_features, m.in_features) for m in self._modules[0]]
        self._pool = [[torch.empty(s, dtype=dtype, device=device) for s in shapes]
                      for _ in range(pool_size)]
        self._pending: dict[int, list] = {}
        self._start = 0.0
        self.stats = PrefetchStats()

    @property
    def pool_bytes(self) -> int:
        """Bytes of the reusable receive buffers (what the memory plan adds per rank)."""
        return sum(b.numel() * b.element_size() for slot in self._pool for b in slot)

    def begin(self) -> None:
        """Issue layer 0's broadcast (a forward's first call)."""
        self._pending.clear()
        self._start = time.perf_counter()
        self._issue(0)

    def before_layer(self, i: int) -> None:
        """Wait for layer ``i``'s weights, install them, issue layer ``i + 1``'s."""
        start = time.perf_counter()
        for work in self._pending.pop(i):
            work.wait()
        self.stats.wait_s += time.perf_counter() - start
        if owner_of(i, self._cp.size) != self._cp.rank:
            for module, buf in zip(self._modules[i], self._slot(i), strict=True):
                module.weight.data = buf
                self.stats.bytes_received += buf.numel() * buf.element_size()
        self.stats.layers += 1
        if i + 1 < self._n:
            self._issue(i + 1)

    def after_layer(self, i: int) -> None:
        """Layer ``i`` is done: a non-owner's modules drop the buffers again (empty
        placeholders), so between forwards a rank holds only the layers it owns."""
        if owner_of(i, self._cp.size) != self._cp.rank:
            for module in self._modules[i]:
                module.weight.data = module.weight.new_empty(0)
        if i == self._n - 1:
            self.stats.forward_s += time.perf_counter() - self._start

    def _slot(self, i: int) -> list[torch.Tensor]:
        return self._pool[i % len(self._pool)]

    def _issue(self, i: int) -> None:
        owner = owner_of(i, self._cp.size)
        tensors = [m.weight.detach() for m in self._modules[i]] if owner == self._cp.rank \
            else self._slot(i)
        self._pending[i] = [self._cp.broadcast(t, owner, async_op=True) for t in tensors]

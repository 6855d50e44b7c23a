"""Quantized modules and the pass that puts them into a built (meta) model.

:func:`quantize_modules` swaps modules of ``model.model.layers`` whose checkpoint weights are
stored quantized (:attr:`QuantPlan.quantized`) for their quantized form, keeping checkpoint
names: under W8A8 a SwiGLU :class:`engine.moe.MLP` with three int8 projections becomes a
:class:`W8A8MLP` and any other int8 ``nn.Linear`` an :class:`Int8Linear`; under FP8 with
``fp8_storage="fp8"`` an FP8 ``nn.Linear`` becomes an :class:`Fp8BlockLinear` (``"dequantize"``
swaps nothing). NOTE: ``kv_b_proj`` is never swapped (absorbed decode reads its weight;
REFERENCE.md "MLA"); quantized weights of modules left float are dequantized by the loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels import KernelSet
from engine.moe import MLP
from engine.quant.formats import FP8_BLOCK, W8A8_INT8, QuantScheme
from engine.quant.fp8_block import Fp8BlockLinear

FP8_STORAGE = ("dequantize", "fp8")
NEVER_QUANTIZED = ("kv_b_proj",)
W8A8MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QuantPlan:
    """How this runtime holds a quantized checkpoint's weights
    (:func:`engine.quant.load.quant_plan`).

    Attributes:
        quantized: checkpoint weight names (``...q_a_proj.weight``) stored quantized.
        fp8_storage: FP8 only: "dequantize" at load or keep "fp8" (:data:`FP8_STORAGE`).

    Raises:
        ValueError: ``fp8_storage`` not in :data:`FP8_STORAGE`.
    """

    scheme: QuantScheme
    quantized: frozenset[str]
    fp8_storage: str = "dequantize"

    def __post_init__(self) -> None:
        if self.fp8_storage not in FP8_STORAGE:
            raise ValueError(f"fp8_storage {self.fp8_storage!r}: use one of "
                             f"{list(FP8_STORAGE)}")


class Int8Linear(nn.Module):
    """Int8 weight ``[out, in]`` + float32 ``weight_scale [out, 1]`` (checkpoint names)."""

    def __init__(self, in_features: int, out_features: int, linear: Callable) -> None:
        super().__init__()
        self.in_features, self.out_features, self.linear = in_features, out_features, linear
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features, 1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, in]`` -> ``[T, out]`` in ``x``'s dtype (the ``w8a8_linear`` kernel)."""
        return self.linear(x, self.weight, self.weight_scale)


class W8A8MLP(nn.Module):
    """SwiGLU MLP in int8 with gate and up fused into one weight (one kernel call).

    Buffers: ``gate_up_weight`` int8 ``[2I, H]`` (checkpoint ``gate_proj`` rows then
    ``up_proj`` rows), ``gate_up_scale [2I, 1]``, ``down_weight`` int8 ``[H, I]``,
    ``down_scale [H, 1]``. :meth:`checkpoint_parts` maps checkpoint names onto them.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, mlp: Callable) -> None:
        super().__init__()
        self.intermediate_size, self.mlp = intermediate_size, mlp
        i, h = intermediate_size, hidden_size
        self.register_buffer("gate_up_weight", torch.empty(2 * i, h, dtype=torch.int8))
        self.register_buffer("gate_up_scale", torch.empty(2 * i, 1, dtype=torch.float32))
        self.register_buffer("down_weight", torch.empty(h, i, dtype=torch.int8))
        self.register_buffer("down_scale", torch.empty(h, 1, dtype=torch.float32))

    def checkpoint_parts(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{"gate_proj": (weight view, scale view), "up_proj": ..., "down_proj": ...}``."""
        i = self.intermediate_size
        return {"gate_proj": (self.gate_up_weight[:i], self.gate_up_scale[:i]),
                "up_proj": (self.gate_up_weight[i:], self.gate_up_scale[i:]),
                "down_proj": (self.down_weight, self.down_scale)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (partial under TP), the ``w8a8_mlp`` kernel."""
        return self.mlp(x, self.gate_up_weight, self.gate_up_scale, self.down_weight,
                        self.down_scale)


def held_quantized(plan: QuantPlan | None, weight_name: str) -> bool:
    """Whether checkpoint weight ``weight_name`` of a plain linear stays quantized in the
    built model: False without a plan, for FP8 dequantized at load, for
    :data:`NEVER_QUANTIZED`."""
    if plan is None or (plan.scheme.method == FP8_BLOCK and plan.fp8_storage == "dequantize"):
        return False
    module = weight_name.removesuffix(".weight")
    return module.rpartition(".")[2] not in NEVER_QUANTIZED and weight_name in plan.quantized


def quantize_modules(model: nn.Module, plan: QuantPlan | None, kernels: KernelSet) -> None:
    """Swap ``model.model.layers``' modules for quantized ones, in place. NOTE: call on the
    meta model after its dtype cast, before ``to_empty`` (new buffers keep int8/fp8/fp32)."""
    if plan is None or (plan.scheme.method == FP8_BLOCK and plan.fp8_storage == "dequantize"):
        return
    _swap(model.model.layers, "model.layers", plan, kernels)


def _swap(parent: nn.Module, prefix: str, plan: QuantPlan, kernels: KernelSet) -> None:
    """Replace ``parent``'s children (recursively; never inside a replaced one)."""
    for child_name, child in list(parent.named_children()):
        name = f"{prefix}.{child_name}"
        new = _quantized(name, child, plan, kernels)
        if new is None:
            _swap(child, name, plan, kernels)
        else:
            setattr(parent, child_name, new)


def _quantized(name: str, module: nn.Module, plan: QuantPlan,
               kernels: KernelSet) -> nn.Module | None:
    """The quantized replacement of ``module`` (named ``name``), or None to keep it."""
    if name.rpartition(".")[2] in NEVER_QUANTIZED:
        return None
    with torch.device("meta"):
        if isinstance(module, MLP) and plan.scheme.method == W8A8_INT8 and all(
                f"{name}.{p}.weight" in plan.quantized for p in W8A8MLP_PARTS):
            return W8A8MLP(module.gate_proj.in_features, module.gate_proj.out_features,
                           kernels.w8a8_mlp)
        if not isinstance(module, nn.Linear) or f"{name}.weight" not in plan.quantized:
            return None
        if plan.scheme.method == FP8_BLOCK:
            return Fp8BlockLinear(module.in_features, module.out_features,
                                  plan.scheme.block_size)
        return Int8Linear(module.in_features, module.out_features, kernels.w8a8_linear)

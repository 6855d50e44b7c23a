"""DeepSeek-V4 MoE (paper §2.1): every layer routes; the first ``hash_moe`` layers pick their
experts by token id (``tid2eid [vocab, k]``), the rest by top-k of ``scores + bias``.

Scores ``sqrtsoftplus(x W_gate^T) = sqrt(log(1 + e^z))`` (or sigmoid / softmax by
``scoring_func``); the picked experts' scores, normalised to sum 1 and times
``routed_scaling_factor``, weight their outputs. Experts and the one shared expert are a
clipped SwiGLU: ``down(silu(min(gate x, L)) * clamp(up x, -L, L))``, ``L = swiglu_limit``.
Expert weights fused as transformers 5.x: ``experts.gate_up_proj [E, 2I, hidden]``,
``experts.down_proj [E, hidden, I]``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.v4.config import HASH_MOE, V4Config

_SCORE = {"sqrtsoftplus": lambda z: F.softplus(z).sqrt(), "sigmoid": torch.sigmoid,
          "softmax": lambda z: z.softmax(dim=-1)}


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """The always-on expert (``gate_proj`` / ``up_proj`` ``[I, hidden]``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clipped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class Experts(nn.Module):
    """Routed experts, fused weights (see module doc). With ``fp8_storage: fp8``
    (:mod:`engine.v4.stored`) ``gate_up_proj`` / ``down_proj`` are quantized stacks
    (:class:`engine.quant.fp8_block.Fp8BlockExperts`, :class:`engine.quant.mxfp4.Mxfp4Experts`)
    whose ``[e]`` is the dequantized float32 matrix: :meth:`expert_weights` casts either."""

    def __init__(self, n_experts: int, hidden_size: int, intermediate: int, limit: float):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.zeros(n_experts, 2 * intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(n_experts, hidden_size, intermediate))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]``, expert ``ids`` / ``weights [T, k]`` -> ``[T, hidden]``."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            gate_up, down = self.expert_weights(e, x.dtype)
            gate, up = F.linear(x[token], gate_up).chunk(2, dim=-1)
            y = F.linear(clipped_swiglu(gate, up, self.limit), down)
            out.index_add_(0, token, y * weights[token, slot, None])
        return out

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert ``e``'s (``gate_up [2I, hidden]``, ``down [hidden, I]``) in ``dtype``."""
        return self.gate_up_proj[e].to(dtype), self.down_proj[e].to(dtype)


class Router(nn.Module):
    """``weight [E, hidden]``; ``e_score_correction_bias [E]`` (top-k layers) or ``tid2eid
    [vocab, k]`` (hash layers)."""

    def __init__(self, config: V4Config, hashed: bool) -> None:
        super().__init__()
        self.k, self.scale = config.num_experts_per_tok, config.routed_scaling_factor
        self.score, self.hashed = _SCORE[config.scoring_func], hashed
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.k,
                                                         dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids and weights ``[T, k]`` for ``x [T, hidden]`` of tokens ``input_ids``."""
        scores = self.score(F.linear(x, self.weight))  # [T, E]
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.k, dim=-1,
                             sorted=False).indices
        weights = scores.gather(1, ids)
        return ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


class V4MoE(nn.Module):
    """Layer ``layer``'s MoE: ``gate`` (router), ``experts`` (all of them, or the given ones:
    :class:`engine.v4.expert_parallel.EPExperts` under EP), ``shared_experts``.

    Under TP (``tp`` ranks, :mod:`engine.v4.tp`) the shared expert, and without EP every
    routed expert, holds ``moe_intermediate_size / tp`` intermediate channels (the clipped
    SwiGLU is elementwise); under EP the routed experts are whole and each TP rank dispatches
    a slice of the tokens (:func:`engine.expert_parallel.ep_routed`). Either way the output is
    this rank's PARTIAL sum (the caller all-reduces once); the router is whole, so every rank
    picks the same experts.
    """

    def __init__(self, config: V4Config, layer: int, tp: int = 1,
                 experts: Experts | None = None) -> None:
        super().__init__()
        inter, limit = config.moe_intermediate_size // tp, config.swiglu_limit
        self.gate = Router(config, hashed=config.mlp_layer_types[layer] == HASH_MOE)
        # NOTE: under EP the caller passes this rank's (engine/v4/expert_parallel.py)
        self.experts = experts if experts is not None else Experts(
            config.n_routed_experts, config.hidden_size, inter, limit)
        # NOTE: transformers sizes the shared expert at moe_intermediate_size, whatever
        # n_shared_experts says (V4 ships 1)
        self.shared_experts = SharedExpert(config.hidden_size, inter, limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]`` (partial under TP)."""
        ids, weights = self.gate(x, input_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)

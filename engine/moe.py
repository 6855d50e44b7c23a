"""DeepSeek MoE feed-forward: router gate, routed experts, shared experts; and the dense MLP.

Maths: REFERENCE.md "Router (MoE gate)" (DeepSeek-V3 ``inference/model.py`` Gate, vLLM
``grouped_topk``). Modules are built with this rank's widths (:mod:`engine.layout`); under EP
only this rank's routed experts exist and tokens reach them by all-to-all
(:mod:`engine.expert_parallel`). NOTE: ``forward`` returns this rank's PARTIAL sum of routed +
shared outputs; the caller all-reduces ONCE over TP.

Fused storage (:func:`fuse_weights`, before loading): a float SwiGLU MLP keeps gate/up as the
halves of one ``[2I, H]`` tensor, and float routed experts live in ``w_gate_up [E, 2I, H]`` and
``w_down [E, H, I]`` (E = this rank's experts) whose slices ARE the checkpoint-named
parameters. Without EP these run as two ``torch._grouped_mm`` calls with no host sync;
quantized experts and EP loop per expert and read the counts to the host once per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.expert_parallel import ep_routed, ep_routed_fixed
from engine.layout import TPLayout
from engine.model_config import ModelConfig
from engine.parallel import EPGroup, TPGroup


class MLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with a (local) intermediate width.

    Attributes:
        gate_up: ``[2I, H]``, rows ``gate_proj`` then ``up_proj`` (their weights are views of
            it) once :meth:`fuse` ran; None before, or when the projections are quantized.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None

    def fusable(self) -> bool:
        """True when all three projections are plain float ``nn.Linear`` (not quantized)."""
        return all(type(p) is nn.Linear for p in (self.gate_proj, self.up_proj, self.down_proj))

    def fuse(self, gate_up: torch.Tensor | None = None, down: torch.Tensor | None = None) -> None:
        """Re-point ``gate_proj``/``up_proj`` at the halves of ``gate_up [2I, H]`` (new storage
        when None) and ``down_proj`` at ``down [H, I]`` (kept when None). Values are NOT
        copied: call before loading. Requires :meth:`fusable`."""
        i = self.gate_proj.weight.shape[0]
        if gate_up is None:
            gate_up = self.gate_proj.weight.new_empty(2 * i, self.gate_proj.weight.shape[1])
        self.gate_proj.weight.data, self.up_proj.weight.data = gate_up[:i], gate_up[i:]
        if down is not None:
            self.down_proj.weight.data = down
        self.gate_up = gate_up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (partial under TP)."""
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoEGate(nn.Module):
    """Router: scores, (group-limited) top-k selection, combine weights.

    ``e_score_correction_bias`` exists for ``topk_method == "noaux_tc"`` (V3) and only steers
    selection; the weights are the unbiased scores of the chosen experts.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size))
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hidden]`` -> (weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64)."""
        cfg = self.config
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            choice = self._mask_groups(choice)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Keep the best ``topk_group`` of ``n_group`` groups; others -> -inf (not 0)."""
        cfg = self.config
        t, e = choice.shape
        grouped = choice.view(t, cfg.n_group, e // cfg.n_group)
        if cfg.topk_method == "noaux_tc":  # V3: sum of the top-2 biased scores per group
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:  # V2 group_limited_greedy: best score per group
            group_scores = grouped.max(dim=-1).values
        keep = group_scores.topk(cfg.topk_group, dim=-1).indices  # [T, topk_group]
        drop = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(drop[..., None], float("-inf")).view(t, e)


class MoE(nn.Module):
    """Routed experts (``experts.{j}``, only this rank's under EP) plus shared experts.

    Shared experts are ``n_shared_experts * layout.moe_intermediate_size`` wide; EP is off at
    ``ep.size == 1``.

    Attributes:
        w_gate_up, w_down: the stacked float experts ``[E, 2I, H]`` / ``[E, H, I]`` once
            :meth:`stack_experts` ran (the experts' parameters are views of them); None
            before, or for quantized experts.
        ep_capacity: None: EP dispatch with exact splits (one host sync per layer); an int:
            the capture-safe fixed-capacity dispatch for steps of at most that many tokens
            per rank (:func:`engine.expert_parallel.ep_routed_fixed`; set by the runner in
            graph mode).
    """

    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup, ep: EPGroup) -> None:
        super().__init__()
        self.tp, self.ep = tp, ep
        self.gate = MoEGate(config)
        self.experts = nn.ModuleDict({str(j): MLP(config.hidden_size,
                                                  layout.expert_intermediate_size)
                                      for j in layout.experts})
        self.w_gate_up: torch.Tensor | None = None
        self.w_down: torch.Tensor | None = None
        self.ep_capacity: int | None = None
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size,
                                      layout.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``: Σ_k w_k expert_k(x) + shared(x), this TP rank's
        PARTIAL sum (the caller all-reduces once over TP). Under EP the routed part is
        complete on this TP rank's token slice and zero elsewhere
        (:mod:`engine.expert_parallel`); ``T`` may be 0 (an empty EP step)."""
        if self.ep.size > 1 and self.ep_capacity is not None:
            out = ep_routed_fixed(x, self.gate, list(self.experts.values()), self.ep, self.tp,
                                  self.ep_capacity)
        elif self.ep.size > 1:
            out = ep_routed(x, self.gate, list(self.experts.values()), self.ep, self.tp)
        elif self.w_gate_up is not None and torch.compiler.is_compiling():
            out = _grouped_routed_op(x, *self.gate(x), self.w_gate_up, self.w_down)
        elif self.w_gate_up is not None:
            out = _grouped_routed(x, *self.gate(x), self.w_gate_up, self.w_down)
        else:
            out = _local_routed(x, *self.gate(x), list(self.experts.values()))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def stack_experts(self) -> None:
        """Allocate ``w_gate_up [E, 2I, H]`` and ``w_down [E, H, I]`` and make every routed
        expert's weights views of its slice (values NOT copied: call before loading). No-op
        when the experts are quantized or there are none."""
        experts = list(self.experts.values())
        if not experts or not all(isinstance(e, MLP) and e.fusable() for e in experts):
            return
        gate, down = experts[0].gate_proj.weight, experts[0].down_proj.weight
        self.w_gate_up = gate.new_empty(len(experts), 2 * gate.shape[0], gate.shape[1])
        self.w_down = down.new_empty(len(experts), *down.shape)
        for j, expert in enumerate(experts):
            expert.fuse(self.w_gate_up[j], self.w_down[j])


def fuse_weights(model: nn.Module) -> None:
    """Fused storage for every float MLP and stacked experts for every MoE of ``model``.
    NOTE: call after ``to_empty``, before loading: the new storage is uninitialized."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.stack_experts()
    for module in model.modules():
        if isinstance(module, MLP) and module.gate_up is None and module.fusable():
            module.fuse()


def _grouped_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Routed output ``[T, hidden]`` in ``x``'s dtype (a partial sum under TP), without EP,
    over stacked experts: two grouped GEMMs, no host sync. ``x [T, hidden]``, ``weights
    [T, k]`` fp32, ``ids [T, k]`` int64 in ``0..E-1``, ``w_gate_up [E, 2I, H]``,
    ``w_down [E, H, I]``."""
    t, k = ids.shape
    sorted_ids, order = ids.view(-1).sort(stable=True)  # [T*k] assignments grouped by expert
    experts = torch.arange(w_gate_up.shape[0], device=ids.device)
    ends = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)  # [E] cumsum
    rows = x[order // k]  # [T*k, hidden]
    gate, up = torch._grouped_mm(rows, w_gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=ends)
    routed = torch.empty_like(out)
    routed[order] = out * weights.view(-1)[order, None].to(x.dtype)
    return routed.view(t, k, x.shape[1]).sum(dim=1)  # NOTE: explicit width: t may be 0 (CP)


@torch.library.custom_op("orch::grouped_routed", mutates_args=())
def _grouped_routed_op(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """:func:`_grouped_routed` as one opaque op inside a graph capture (torch 2.13's fake
    ``_grouped_mm`` accepts bf16 only)."""
    return _grouped_routed(x, weights, ids, w_gate_up, w_down)


@_grouped_routed_op.register_fake
def _grouped_routed_fake(x, weights, ids, w_gate_up, w_down):
    return torch.empty_like(x)


def _local_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  experts: list[nn.Module]) -> torch.Tensor:
    """Routed output without EP, one expert module at a time (quantized experts): every
    expert is here (TP-split: a partial sum). Reads the per-expert counts to the host."""
    t, k = ids.shape
    flat = ids.view(-1)
    order = flat.argsort(stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    routed = x.new_empty(t * k, x.shape[1])  # [T*k, hidden], one row per assignment
    start = 0
    for expert, n in zip(experts, counts):
        if n:
            pick = order[start:start + n]
            routed[pick] = expert(x[pick // k]) * weights.view(-1)[pick, None].to(x.dtype)
        start += n
    return routed.view(t, k, x.shape[1]).sum(dim=1)  # NOTE: explicit width: t may be 0 (CP)

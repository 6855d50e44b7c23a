"""DeepSeek MoE feed-forward: router gate, routed experts, shared experts; and the dense MLP.

Maths: REFERENCE.md "Router (MoE gate)" (DeepSeek-V3 ``inference/model.py`` Gate, vLLM
``grouped_topk``). TP: modules are built with this rank's intermediate width (every expert's,
the shared experts' and the dense MLP's are split: gate/up rows, down columns; see
:mod:`engine.layout`). EP: only this rank's routed experts exist, whole, and tokens reach
them by all-to-all (:mod:`engine.expert_parallel`); the gate is replicated and unchanged.
``forward`` returns this rank's PARTIAL sum of routed + shared outputs; the caller
all-reduces ONCE over TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.expert_parallel import ep_routed
from engine.layout import TPLayout
from engine.model_config import ModelConfig
from engine.parallel import EPGroup, TPGroup


class MLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with a (local) intermediate width."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` (partial under TP)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    Args:
        config: model config. layout: this rank's sizes (routed expert width and ids,
            shared experts' width: ``n_shared_experts * layout.moe_intermediate_size``).
        tp, ep: this rank's groups (EP off at ``ep.size == 1``).
    """

    def __init__(self, config: ModelConfig, layout: TPLayout, tp: TPGroup, ep: EPGroup) -> None:
        super().__init__()
        self.tp, self.ep = tp, ep
        self.gate = MoEGate(config)
        self.experts = nn.ModuleDict({str(j): MLP(config.hidden_size,
                                                  layout.expert_intermediate_size)
                                      for j in layout.experts})
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = MLP(config.hidden_size,
                                      layout.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]``: Σ_k w_k expert_k(x) + shared(x), this TP rank's
        PARTIAL sum (the caller all-reduces once over TP). Under EP the routed part is
        complete on this TP rank's token slice and zero elsewhere
        (:mod:`engine.expert_parallel`); ``T`` may be 0 (an empty EP step)."""
        experts = list(self.experts.values())
        if self.ep.size > 1:
            out = ep_routed(x, self.gate, experts, self.ep, self.tp)
        else:
            out = _local_routed(x, *self.gate(x), experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _local_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  experts: list[nn.Module]) -> torch.Tensor:
    """Routed output without EP: every expert is here (TP-split: a partial sum)."""
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

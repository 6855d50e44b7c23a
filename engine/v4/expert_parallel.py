"""DeepSeek-V4 expert parallelism: V3's EP (docs/engine.md "Parallel layout") over V4's MoE.

All ranks of a role form one EP group (tp 1: EP rank = DP rank); each runs attention, mHC,
the router and the shared expert for its own requests (DP attention) and holds only its
``n_local = n_routed_experts / ep`` whole routed experts, ids ``ep.rank * n_local ...``
(:func:`engine.layout.expert_range`, V3's rule), in every layer. Hash-routed layers are no
different: ``tid2eid`` (replicated with the router) gives each token's global expert ids by
token id on the token's own rank, and the rows go to those ids' owners as top-k ones do.

Per layer :class:`EPExperts` hands the router's picks to
:func:`engine.expert_parallel.ep_routed` (the same dispatch / combine all-to-alls, one host
sync): each token's k rows go to their experts' owners, come back as expert outputs, and are
weighted and summed on the sender. A DP rank with no work in a lockstep step runs
:func:`exchange_empty` (zero rows through every layer's all-to-alls) so the others' step
completes (``V4Runner.execute_empty``).

NOTE: the order of the k-sum differs from :class:`engine.v4.moe.Experts`' (per expert
``index_add_``), so EP logits match EP-off ones to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.expert_parallel import ep_routed
from engine.layout import expert_range
from engine.parallel import EPGroup, TPGroup
from engine.v4.config import V4Config
from engine.v4.moe import Experts, clipped_swiglu


class EPExperts(Experts):
    """This EP rank's routed experts of one layer: :class:`Experts`' fused weights for
    ``n_local`` experts (``gate_up_proj [n_local, 2I, hidden]``, ``down_proj [n_local,
    hidden, I]``, the checkpoint's experts ``expert_ids``), the others reached by all-to-all.

    Attributes:
        expert_ids: the global ids held (a ``range``; the loader reads only these).
        num_experts: ``n_routed_experts`` of the whole model.

    Raises:
        ValueError: ``ep.size`` does not divide ``n_routed_experts`` (names the sizes that
            would), from :func:`engine.layout.expert_range`.
    """

    def __init__(self, config: V4Config, ep: EPGroup) -> None:
        ids = expert_range(config, ep.size, ep.rank)
        super().__init__(len(ids), config.hidden_size, config.moe_intermediate_size,
                         config.swiglu_limit)
        self.expert_ids, self.num_experts, self.ep = ids, config.n_routed_experts, ep

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (T may be 0), global expert ``ids`` / ``weights [T, k]`` ->
        ``[T, hidden]``: each token's weighted sum over its k experts, wherever they live.
        Collective: every rank of the EP group calls it for the same layer in the same order.
        """
        experts = [self._expert(e) for e in range(len(self.expert_ids))]
        return ep_routed(x, lambda _: (weights, ids), experts, self.ep, TPGroup())

    def _expert(self, e: int):
        def run(rows: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, hidden]
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
            return F.linear(clipped_swiglu(gate, up, self.limit), self.down_proj[e])
        return run


def ep_experts(config: V4Config, ep: EPGroup | None) -> Experts | None:
    """The experts module a V4 MoE layer gets: :class:`EPExperts` under EP (``ep.size > 1``),
    else None (the layer builds all of them, :class:`engine.v4.moe.Experts`)."""
    return EPExperts(config, ep) if ep is not None and ep.size > 1 else None


@torch.no_grad()
def exchange_empty(model) -> None:
    """A zero-token step of ``model`` (:class:`engine.v4.model.DeepseekV4ForCausalLM`): every
    layer's MoE with no rows, in layer order, so this rank meets the EP all-to-alls of the
    other DP ranks' step. Touches no cache."""
    weight = model.lm_head.weight
    x = weight.new_empty(0, model.config.hidden_size)
    input_ids = torch.empty(0, dtype=torch.int64, device=weight.device)
    for layer in model.model.layers:
        layer.mlp(x, input_ids)

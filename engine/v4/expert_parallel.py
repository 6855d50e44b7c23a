"""DeepSeek-V4 expert parallelism: V3's EP (docs/engine.md "Parallel layout") over V4's MoE.

All ranks of a role (dp x tp: EP rank of TP rank ``r`` of DP rank ``d`` is ``d * tp + r``,
:func:`engine.parallel.ep_rank_of`, as for V3) form one EP group; each DP rank runs attention,
mHC, the router and the shared expert for its own requests (DP attention; under TP split as
:mod:`engine.v4.tp` says) and each rank holds only its ``n_local = n_routed_experts / ep``
whole routed experts, ids ``ep.rank * n_local ...`` (:func:`engine.layout.expert_range`, V3's
rule), in every layer. Hash-routed layers are no different: ``tid2eid`` (replicated with the
router) gives each token's global expert ids by token id on the token's own rank, and the rows
go to those ids' owners as top-k ones do.

Per layer :class:`EPExperts` hands the router's picks to
:func:`engine.expert_parallel.ep_routed` (the same dispatch / combine all-to-alls, one host
sync): TP rank ``r`` sends only its contiguous slice of the DP rank's tokens
(:func:`engine.expert_parallel.token_slice`; every TP rank computed the same picks); each
token's k rows go to their experts' owners, come back as expert outputs, and are weighted and
summed on the sender. INVARIANT (as V3's): the routed output is complete on this TP rank's
token slice and zero elsewhere, so the decoder layer's TP all-reduce (after adding the
TP-split shared expert's partial sum) counts it once. A DP rank with no work in a lockstep
step runs :func:`exchange_empty` on all its ranks (zero rows through every layer's
all-to-alls) so the others' step completes (``V4Runner.execute_empty``).

NOTE: the order of the k-sum differs from :class:`engine.v4.moe.Experts`' (per expert
``index_add_``), so EP logits match EP-off ones to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.expert_parallel import ep_routed, token_slice
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

    Args:
        ep: this rank's EP group (all dp x tp ranks of the role). tp: its TP group (None: tp
            1); each TP rank dispatches its slice of the tokens.

    Raises:
        ValueError: ``ep.size`` does not divide ``n_routed_experts`` (names the sizes that
            would), from :func:`engine.layout.expert_range`.
    """

    def __init__(self, config: V4Config, ep: EPGroup, tp: TPGroup | None = None) -> None:
        ids = expert_range(config, ep.size, ep.rank)
        super().__init__(len(ids), config.hidden_size, config.moe_intermediate_size,
                         config.swiglu_limit)
        self.expert_ids, self.num_experts, self.ep = ids, config.n_routed_experts, ep
        self.tp = tp or TPGroup()

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` (T may be 0; the same on every TP rank), global expert ``ids`` /
        ``weights [T, k]`` -> ``[T, hidden]``: on this TP rank's token slice each token's
        weighted sum over its k experts, wherever they live; zero elsewhere (tp 1: every
        token). Collective: every rank of the EP group calls it for the same layer in the same
        order."""
        part = token_slice(x.shape[0], self.tp)
        experts = [self._expert(e) for e in range(len(self.expert_ids))]
        return ep_routed(x, lambda _: (weights[part], ids[part]), experts, self.ep, self.tp)

    def _expert(self, e: int):
        def run(rows: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, hidden]
            gate_up, down = self.expert_weights(e, rows.dtype)
            gate, up = F.linear(rows, gate_up).chunk(2, dim=-1)
            return F.linear(clipped_swiglu(gate, up, self.limit), down)
        return run


def ep_experts(config: V4Config, ep: EPGroup | None,
               tp: TPGroup | None = None) -> Experts | None:
    """The experts module a V4 MoE layer gets: :class:`EPExperts` under EP (``ep.size > 1``;
    ``tp``: the rank's TP group), else None (the layer builds all of them, TP-split,
    :class:`engine.v4.moe.Experts`)."""
    return EPExperts(config, ep, tp) if ep is not None and ep.size > 1 else None


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

"""Expert-parallel MoE: dispatch token rows to the EP ranks owning their experts, combine back.

Each EP rank holds ``n_local = n_routed_experts / ep`` whole experts (ids from
``ep.rank * n_local``). Per MoE layer, TP rank ``r`` routes only its contiguous slice of the
DP rank's tokens (:func:`token_slice`); its ``T_r * k`` assignments, sorted by expert (hence
owner), go out by three all-to-alls: per-expert counts (one ``.tolist()`` gives the splits),
hidden rows, and the experts' results back; the sender weights and sums each token's k rows.

INVARIANT (with the decoder layer's TP all-reduce): :func:`ep_routed` returns each token's
COMPLETE routed output on this TP rank's slice and zero elsewhere, so the TP sum adds it once.
NOTE: a rank with zero tokens still enters all three all-to-alls, with zero-row splits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.parallel import EPGroup, TPGroup


def token_slice(num_tokens: int, tp: TPGroup) -> slice:
    """The contiguous tokens TP rank ``tp.rank`` dispatches (possibly empty)."""
    return slice(num_tokens * tp.rank // tp.size, num_tokens * (tp.rank + 1) // tp.size)


def ep_routed(x: torch.Tensor, gate: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
              experts: list[nn.Module], ep: EPGroup, tp: TPGroup) -> torch.Tensor:
    """Routed-expert output ``[T, hidden]`` of ``x [T, hidden]`` (same on every TP rank of
    the DP rank) under EP. ``gate``: ``[Tr, hidden]`` -> (fp32 weights, int64 global ids),
    each ``[Tr, k]``. ``experts``: this rank's ``n_local``, in id order.

    Shapes: Tr this TP rank's slice, k experts per token, E = ep.size * n_local,
    A = Tr * k assignments, R rows received.
    """
    part = token_slice(x.shape[0], tp)
    xs = x[part]  # [Tr, hidden]
    weights, ids = gate(xs)  # [Tr, k]
    k, n_local, flat = ids.shape[1], len(experts), ids.reshape(-1)  # flat [A]
    order = flat.argsort(stable=True)  # assignments grouped by expert, hence by owner
    send_counts = torch.bincount(flat, minlength=n_local * ep.size)  # [E]
    recv_counts = ep.all_to_all_counts(send_counts)  # [E]: block r = rank r's, my experts
    by_rank = recv_counts.view(ep.size, n_local)
    sizes = torch.cat((send_counts.view(ep.size, n_local).sum(1), by_rank.sum(1),
                       by_rank.sum(0))).tolist()  # the one host sync of the layer
    send_splits, recv_splits = sizes[:ep.size], sizes[ep.size:2 * ep.size]
    received = ep.all_to_all_rows(xs[order // k], send_splits, recv_splits)  # [R, hidden]
    local_ids = torch.arange(n_local, device=x.device).repeat(ep.size)
    local_ids = local_ids.repeat_interleave(recv_counts)  # [R]: local expert of each row
    computed = _run_experts(received, local_ids, sizes[2 * ep.size:], experts)  # [R, hidden]
    returned = ep.all_to_all_rows(computed, recv_splits, send_splits)  # [A, hidden], by order
    rows = torch.empty_like(returned)
    rows[order] = returned * weights.reshape(-1)[order, None].to(x.dtype)
    out = torch.zeros_like(x)
    out[part] = rows.view(-1, k, x.shape[1]).sum(dim=1)
    return out


def _run_experts(rows: torch.Tensor, local_ids: torch.Tensor, per_expert: list[int],
                 experts: list[nn.Module]) -> torch.Tensor:
    """Each row through expert ``local_ids[i]``; ``per_expert[e]`` rows go to expert ``e``.

    Returns ``[len(rows), hidden]`` in the rows' order."""
    order = local_ids.argsort(stable=True)
    grouped, start = rows[order], 0
    out = torch.empty_like(rows)
    for expert, n in zip(experts, per_expert):
        if n:
            out[order[start:start + n]] = expert(grouped[start:start + n])
        start += n
    return out

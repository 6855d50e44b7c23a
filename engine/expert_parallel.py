"""Expert-parallel MoE: dispatch token rows to the EP ranks owning their experts, combine back.

Each EP rank holds ``n_local = n_routed_experts / ep`` whole experts (ids from
``ep.rank * n_local``). Per MoE layer, TP rank ``r`` routes only its contiguous slice of the
DP rank's tokens (:func:`token_slice`); its ``T_r * k`` assignments, sorted by expert (hence
owner), go out by three all-to-alls: per-expert counts (one ``.tolist()`` gives the splits),
hidden rows, and the experts' results back; the sender weights and sums each token's k rows.

Graph mode (a captured step must not sync with the host): :func:`ep_routed_fixed` sends every
rank a fixed slot of ``capacity * k`` rows (padded; each row carries its local expert id, -1
for padding) by equal-split all-to-alls, and runs every local expert on every received row
(masked), so no split size ever leaves the device. All ranks of the group must use the same
path (the collectives differ): the runner turns it on for every step when graph mode and EP
are both on (:attr:`engine.moe.MoE.ep_capacity`).

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


def ep_routed_fixed(x: torch.Tensor,
                    gate: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                    experts: list[nn.Module], ep: EPGroup, tp: TPGroup,
                    capacity: int) -> torch.Tensor:
    """:func:`ep_routed` without a host sync (capture-safe): same contract and result.

    ``capacity``: most tokens any TP rank of any DP rank routes in one step (the same on
    every rank of the group). Each rank sends each rank ``S = capacity * k`` rows (its
    assignments to that rank's experts, then zero padding) and gets ``S`` from each.

    Shapes: Tr this TP rank's slice, A = Tr * k, S slot rows, P = ep.size * S.

    Raises:
        ValueError: this rank's slice has more than ``capacity`` tokens (a Python int
            compare: no sync); raise the capacity (graph mode: the largest bucket).
    """
    part = token_slice(x.shape[0], tp)
    xs = x[part]  # [Tr, hidden]
    if xs.shape[0] > capacity:
        raise ValueError(f"EP fixed-capacity dispatch: {xs.shape[0]} tokens on this rank > "
                         f"capacity {capacity}; with graph mode and EP every step must fit "
                         "the largest graph bucket (raise decode.graph.batch_sizes' last "
                         "size to decode.max_num_seqs)")
    weights, ids = gate(xs)  # [Tr, k]
    k, n_local, flat = ids.shape[1], len(experts), ids.reshape(-1)  # flat [A]
    slot_rows, parts = capacity * k, ep.size
    order = flat.argsort(stable=True)
    owner = flat[order] // n_local  # [A]: destination rank of each sorted assignment
    per_rank = torch.zeros(parts, dtype=torch.long, device=x.device).index_add_(
        0, owner, torch.ones_like(owner))  # NOTE: not bincount (its size would sync)
    start = per_rank.cumsum(0) - per_rank
    slot = owner * slot_rows + torch.arange(owner.shape[0], device=x.device) - start[owner]
    rows = xs.new_zeros((parts * slot_rows, xs.shape[1]))
    rows[slot] = xs[order // k]
    local = torch.full((parts * slot_rows,), -1, dtype=torch.long, device=x.device)
    local[slot] = flat[order] % n_local
    splits = [slot_rows] * parts
    received = ep.all_to_all_rows(rows, splits, splits)  # [P, hidden]
    local_in = ep.all_to_all_counts(local)  # [P]: -1 = padding
    computed = torch.zeros_like(received)
    for e, expert in enumerate(experts):
        computed = computed + torch.where((local_in == e)[:, None], expert(received), 0)
    returned = ep.all_to_all_rows(computed, splits, splits)[slot]  # [A], sorted order
    out_rows = torch.empty_like(returned)
    out_rows[order] = returned * weights.reshape(-1)[order, None].to(x.dtype)
    out = torch.zeros_like(x)
    out[part] = out_rows.view(-1, k, x.shape[1]).sum(dim=1)
    return out

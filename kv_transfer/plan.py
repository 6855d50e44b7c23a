"""Transfer plan ("layer sharding"): which layers/heads/tokens flow on which (prefill, decode)
pair.

A pure function of (prefill tp, decode tp, num_layers, kind[, num_kv_heads][, prefill cp]);
DESIGN.md "Transfer plan". Method, for every KV head ``h`` (MLA: one pseudo-head held by every
rank) of one prefill TP group:

1. ``holders`` = prefill ranks holding ``h``; ``needers`` = decode ranks holding ``h``
   (:func:`kv_transfer.layout.rank_heads`; MLA: all ranks).
2. With ``g = gcd(len(holders), len(needers))``, holders and needers are cut into ``g``
   equal consecutive groups; group ``i`` of holders serves group ``i`` of needers.
3. Within a group, the work items ``(decode rank, layer)`` in decode-rank-major order are cut
   into as many contiguous runs as the group has holders, run lengths differing by at most
   one; run ``j`` goes to the group's ``j``-th holder.

Properties (tests/kv_transfer/test_plan.py checks them for 1..8 x 1..8 and 1..61 layers):
every (decode rank, head, layer) is sent exactly once; each prefill rank's bytes are within
one layer (of one head) of every other's; contiguous runs keep each prefill rank on as few
decode ranks as possible, so links work in parallel. P16->D4: rank p sends layer quarter
``p % 4`` to decode rank ``p // 4``; P1->D2: rank 0 sends all layers to both; P2->D1: each
sends half. A pair (p, d) carries one layer tuple and one contiguous head range (GQA: with
tp <= heads a head has one holder that sends every layer; with tp > heads a rank holds one
head), so it is represented as one :class:`PairPlan`.

Completion: a decode rank is complete when every planned layer arrived and a ``done`` record
came from every prefill rank in ``recvs_to(d)``. Every decode rank has at least one such rank.
A prefill rank with no pair (e.g. P8->D1 with 1 layer) neither sends nor is waited for; its
``finish`` and ``wait`` return at once.

Context-parallel prefill (``prefill_cp`` = c > 1): the instance is c TP groups of
``prefill_tp`` ranks (prefill rank ``p = cp_rank * prefill_tp + tp_rank``); CP rank ``r``
computes pieces ``r`` and ``2c-1-r`` of every chunk cut in 2c pieces
(:func:`engine.context_parallel.cp_token_slices`, the load-balanced causal order) and ships
only those tokens: each TP group is planned as
above (layers/heads over its ranks) for its own tokens. So every (decode rank, head, layer,
token) is still sent exactly once, and each prefill rank's tokens per chunk are within two of
every other's (bytes within one layer plus two tokens, all layers, of every other's). A pair
then carries only part of its layers' tokens: the decode side counts (layer, token) cells over
all its pairs (:mod:`~kv_transfer.tracker`). P(cp2) -> D1: ranks 0 and 1 each send every layer,
rank 0 tokens ``[0, n/4) + [3n/4, n)`` of an n-token chunk, rank 1 the middle half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from engine.context_parallel import cp_token_slices
from kv_transfer.layout import KINDS, rank_heads


@dataclass(frozen=True)
class PairPlan:
    """What flows from ``prefill_rank`` to ``decode_rank``.

    Attributes:
        layers: layer ids, ascending.
        heads: global KV heads (GQA), None for MLA (the whole latent).
        cp_rank: the prefill rank's context-parallel rank (0 without CP): the pair ships the
            tokens of :meth:`TransferPlan.token_ranges` of that rank, all of them without CP.
    """

    prefill_rank: int
    decode_rank: int
    layers: tuple[int, ...]
    heads: range | None
    cp_rank: int = 0


@dataclass(frozen=True)
class TransferPlan:
    """All pairs of one (prefill instance, decode instance) combination; see module docstring."""

    prefill_tp: int
    decode_tp: int
    num_layers: int
    kind: str
    num_kv_heads: int | None
    pairs: tuple[PairPlan, ...]
    prefill_cp: int = 1

    def sends_from(self, prefill_rank: int) -> tuple[PairPlan, ...]:
        """Pairs prefill rank ``prefill_rank`` sends on (possibly empty)."""
        return tuple(p for p in self.pairs if p.prefill_rank == prefill_rank)

    def recvs_to(self, decode_rank: int) -> tuple[PairPlan, ...]:
        """Pairs decode rank ``decode_rank`` receives on (never empty)."""
        return tuple(p for p in self.pairs if p.decode_rank == decode_rank)

    def token_ranges(self, prefill_rank: int, token_start: int,
                     token_end: int) -> tuple[tuple[int, int], ...]:
        """Token ranges ``[a, b)`` of chunk ``[token_start, token_end)`` that prefill rank
        ``prefill_rank`` ships (on each of its pairs): the whole chunk without CP, else its
        CP rank's pieces (:func:`cp_token_slices`: the tokens it computed), ascending, empty
        ones left out."""
        if self.prefill_cp == 1:
            return ((token_start, token_end),)
        pieces = cp_token_slices(token_end - token_start, self.prefill_cp,
                                 prefill_rank // self.prefill_tp)
        return tuple((token_start + p.start, token_start + p.stop) for p in pieces if p)


def build_transfer_plan(prefill_tp: int, decode_tp: int, num_layers: int, kind: str = "mla",
                        num_kv_heads: int | None = None, prefill_cp: int = 1) -> TransferPlan:
    """Plan the pairs of a prefill instance of ``prefill_cp`` x ``prefill_tp`` ranks and a
    decode one of ``decode_tp``.

    Raises:
        ValueError: non-positive sizes, unknown kind, missing ``num_kv_heads`` for gqa, or a
            tp that cannot split the heads (see :func:`rank_heads`).
    """
    if min(prefill_tp, decode_tp, num_layers, prefill_cp) <= 0:
        raise ValueError(f"prefill_tp ({prefill_tp}), decode_tp ({decode_tp}), num_layers "
                         f"({num_layers}) and prefill_cp ({prefill_cp}) must be positive")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if (kind == "gqa") != (num_kv_heads is not None):
        raise ValueError("num_kv_heads is required for kind='gqa' and must be None for 'mla'")
    heads = 1 if kind == "mla" else num_kv_heads
    # (p, d) -> {head: [layers]}
    work: dict[tuple[int, int], dict[int, list[int]]] = {}
    for head in range(heads):
        holders = _holding(prefill_tp, kind, num_kv_heads, head)
        needers = _holding(decode_tp, kind, num_kv_heads, head)
        groups = math.gcd(len(holders), len(needers))
        for senders, receivers in zip(_cut(holders, groups), _cut(needers, groups)):
            items = [(d, layer) for d in receivers for layer in range(num_layers)]
            for holder, run in zip(senders, _cut(items, len(senders))):
                for d, layer in run:
                    work.setdefault((holder, d), {}).setdefault(head, []).append(layer)
    group = [_pair(p, d, per_head, kind) for (p, d), per_head in sorted(work.items())]
    # NOTE: one TP group's plan per CP rank (module docstring): same layers, its own tokens.
    pairs = tuple(replace(pp, prefill_rank=c * prefill_tp + pp.prefill_rank, cp_rank=c)
                  for c in range(prefill_cp) for pp in group)
    return TransferPlan(prefill_tp, decode_tp, num_layers, kind, num_kv_heads, pairs,
                        prefill_cp)


def _holding(tp: int, kind: str, num_kv_heads: int | None, head: int) -> list[int]:
    """Ranks of an instance of ``tp`` that hold ``head`` (MLA: every rank)."""
    if kind == "mla":
        return list(range(tp))
    return [r for r in range(tp) if head in rank_heads(tp, num_kv_heads, r)]


def _cut(items: list, parts: int) -> list[list]:
    """Cut ``items`` into ``parts`` contiguous runs whose lengths differ by at most one."""
    base, extra = divmod(len(items), parts)
    runs, start = [], 0
    for j in range(parts):
        end = start + base + (1 if j < extra else 0)
        runs.append(items[start:end])
        start = end
    return runs


def _pair(p: int, d: int, per_head: dict[int, list[int]], kind: str) -> PairPlan:
    layer_sets = {tuple(layers) for layers in per_head.values()}
    head_ids = sorted(per_head)
    # NOTE: see module docstring: one layer tuple and a contiguous head range per pair.
    assert len(layer_sets) == 1 and head_ids == list(range(head_ids[0], head_ids[-1] + 1))
    heads = None if kind == "mla" else range(head_ids[0], head_ids[-1] + 1)
    return PairPlan(p, d, layer_sets.pop(), heads)

"""DeepSeek-V4 tensor parallelism: which weights split over the TP group, and how.

Split (DeepSeek's reference ``inference/model.py`` shards the same parts; ``tp`` ranks, rank
``r`` holds the ``r``-th of ``tp`` contiguous parts of the named dim):

=============================================  ===========================  =================
parameter (``L.`` = ``model.layers.{i}.``)     split dim                    tp must divide
=============================================  ===========================  =================
``L.self_attn.q_b_proj.weight [H*D, q_lora]``  0 (query heads)              H
``L.self_attn.sinks [H]``                      0 (query heads)              H
``L.self_attn.o_a_proj.weight [g*r_o, H*D/g]`` 0 by whole groups; tp > g:   g, or g divides tp
                                               a group's rows, 1 in tp/g
``L.self_attn.o_b_proj.weight [h, g*r_o]``     1 by whole groups; tp > g:   g, or g divides tp
                                               the group's columns
``L.mlp.experts.gate_up_proj [E, 2I, h]``      1, gate and up halves each   I
``L.mlp.experts.down_proj [E, h, I]``          2                            I
``L.mlp.shared_experts.{gate,up}_proj``        0                            I
``L.mlp.shared_experts.down_proj``             1                            I
``model.embed_tokens``, ``lm_head``            0 (vocab)                    vocab_size
everything else                                replicated                   -
=============================================  ===========================  =================

So a rank runs ``H / tp`` query heads (group ``j`` holds heads ``j*H/g .. (j+1)*H/g - 1``):
with tp <= g exactly the heads of its ``g / tp`` whole output groups; with tp > g a
``g / tp`` share of one group, whose ``o_a_proj`` input columns it holds (a partial group
output: the projections after attention are linear, so the partial sums add up) and whose
``o_b_proj`` columns it shares with the group's other ``tp / g - 1`` ranks. Every expert
holds ``1 / tp`` of its intermediate channels. Replicated: the single shared K=V head
(``kv_proj``, ``kv_norm``), ``q_a_proj`` (its output also feeds the indexer), the compressors
and the CSA indexer, the hyper-connections, the norms and the router (``tid2eid`` too): every
TP rank computes and holds the WHOLE V4 cache (window, compressed entries, index keys,
compressor state), as MLA's latent is whole on every rank. NOTE: o_b_proj's and the MoE's
outputs are PARTIAL sums; each decoder layer all-reduces after attention and after the MoE
(routed + shared summed first); the embedding all-reduces (rows outside a rank's vocab part
are zero there) and lm_head all-gathers its vocab parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from engine.v4.config import V4Config

_L = r"model\.layers\.\d+\."


@dataclass(frozen=True)
class V4Split:
    """How the parameters fully matching ``pattern`` split: ``dim`` in ``tp`` contiguous
    parts; ``halves``: the dim is two stacked halves (gate, up) split each; ``group``: the
    grouped output projection (``o_a`` / ``o_b``: by whole groups, or within one group when
    tp > o_groups, :func:`output_groups`)."""

    pattern: str
    dim: int
    halves: bool = False
    group: str = ""


SPLITS: tuple[V4Split, ...] = (
    V4Split(_L + r"self_attn\.q_b_proj\.weight", 0),
    V4Split(_L + r"self_attn\.sinks", 0),
    V4Split(_L + r"self_attn\.o_a_proj\.weight", 0, group="o_a"),
    V4Split(_L + r"self_attn\.o_b_proj\.weight", 1, group="o_b"),
    V4Split(_L + r"mlp\.experts\.gate_up_proj", 1, halves=True),
    V4Split(_L + r"mlp\.experts\.down_proj", 2),
    V4Split(_L + r"mlp\.shared_experts\.(gate_proj|up_proj)\.weight", 0),
    V4Split(_L + r"mlp\.shared_experts\.down_proj\.weight", 1),
    V4Split(r"model\.embed_tokens\.weight", 0),
    V4Split(r"lm_head\.weight", 0),
)
_COMPILED = tuple((re.compile(s.pattern), s) for s in SPLITS)


def split_of(name: str) -> V4Split | None:
    """The split of model parameter ``name`` (None: replicated)."""
    for pattern, split in _COMPILED:
        if pattern.fullmatch(name):
            return split
    return None


def output_groups(o_groups: int, tp: int) -> tuple[int, int]:
    """(output groups a rank holds, ranks sharing each group): ``(g / tp, 1)`` when tp
    divides g, ``(1, tp / g)`` when g divides tp.

    Raises:
        ValueError: neither divides the other.
    """
    if o_groups % tp == 0:
        return o_groups // tp, 1
    if tp % o_groups == 0:
        return 1, tp // o_groups
    raise ValueError(f"tp={tp} and DeepSeek-V4's o_groups={o_groups} (config.json): one must "
                     "divide the other (the grouped output projection splits by whole groups, "
                     "or each group over tp / o_groups ranks)")


def check_tp(config: V4Config, tp: int) -> None:
    """Raise ValueError unless ``tp`` splits what it must (module doc).

    Raises:
        ValueError: names the field, its value and the tp sizes that would work.
    """
    sizes = {"num_attention_heads": config.num_attention_heads,
             "moe_intermediate_size": config.moe_intermediate_size,
             "vocab_size": config.vocab_size}
    for field, n in sizes.items():
        if tp < 1 or n % tp:
            ok = [d for d in range(1, min(sizes.values()) + 1)
                  if all(v % d == 0 for v in sizes.values())]
            raise ValueError(f"tp={tp} does not divide DeepSeek-V4's {field}={n} (config.json): "
                             f"use a tp that divides {', '.join(sizes)} ({ok})")
    output_groups(config.o_groups, tp)


class V4Shards:
    """Where TP rank ``rank`` of ``tp`` finds its parameters in the whole checkpoint tensors
    (the module's table); ``o_groups``: the config's."""

    def __init__(self, o_groups: int, tp: int, rank: int) -> None:
        self.tp, self.rank = tp, rank
        self.o_groups = o_groups
        self.per_rank, self.sharing = output_groups(o_groups, tp)

    def full_shape(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint (whole) shape of parameter ``name`` whose rank shape is ``local``."""
        split, shape = split_of(name), list(local)
        if split is None:
            return tuple(shape)
        if split.group and self.sharing > 1:  # NOTE: one group's part on this rank
            shape[split.dim] *= self.o_groups
            if split.group == "o_a":
                shape[1] *= self.sharing
            return tuple(shape)
        shape[split.dim] *= self.tp
        return tuple(shape)

    def pieces(self, name: str, local: tuple[int, ...]) -> dict[int, int]:
        """Per dim that the split of parameter ``name`` (rank shape ``local``) cuts, the size
        of the contiguous pieces it cuts the whole tensor into (empty: replicated or tp 1).
        A quantized copy (FP8 128 x 128 blocks, MXFP4 32-wide scales) splits the same way
        iff each piece is a whole number of its blocks along that dim."""
        split = split_of(name)
        if split is None or self.tp == 1:
            return {}
        if split.halves:
            return {split.dim: local[split.dim] // 2}
        out = {split.dim: local[split.dim]}
        if split.group == "o_a" and self.sharing > 1:
            out[1] = local[1]
        return out

    def local_part(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole checkpoint tensor ``whole`` of parameter ``name``
        (``whole`` itself when replicated or tp 1)."""
        split, tp, rank = split_of(name), self.tp, self.rank
        if split is None or tp == 1:
            return whole
        if split.halves:
            gate, up = whole.chunk(2, dim=split.dim)
            return torch.cat([h.chunk(tp, dim=split.dim)[rank] for h in (gate, up)],
                             dim=split.dim)
        if split.group and self.sharing > 1:
            group = whole.chunk(self.o_groups, dim=split.dim)[rank // self.sharing]
            if split.group == "o_a":
                group = group.chunk(self.sharing, dim=1)[rank % self.sharing]
            return group
        return whole.chunk(tp, dim=split.dim)[rank]

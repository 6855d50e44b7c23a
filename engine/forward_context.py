"""Per-step attention metadata: the one object that carries a step's layout to every layer.

A step is a token-flattened batch of T tokens from B sequences, sequence b owning the next
``query_len`` rows of the batch. Sequence b already has ``context_len`` tokens in the KV
cache (positions ``0..context_len-1``); the step computes positions
``context_len .. context_len + query_len - 1``.

A sequence is a DECODE sequence when ``query_len == 1 and context_len > 0``; every other
sequence (a prompt or a prefill chunk) is a PREFILL sequence.

Scope: the runner builds one :class:`AttentionMetadata` per ``execute`` call and passes it
down the forward explicitly (model -> layer -> attention); nothing is stored globally, so two
runners (or threads) never see each other's step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.block_pool import slot_mapping

if TYPE_CHECKING:
    from engine.context_parallel import CPStep


@dataclass(frozen=True)
class PrefillSeq:
    """One prefill sequence of the step.

    Attributes:
        start, end: its tokens in the flattened batch ``[start, end)``.
        context_len: tokens already cached before this step.
        prefix_slots: cache slots of positions ``0..context_len-1`` ``[context_len]`` int64.
    """

    start: int
    end: int
    context_len: int
    prefix_slots: torch.Tensor


@dataclass(frozen=True)
class DecodeBatch:
    """The decode sequences of the step, batched.

    Attributes:
        token_index: their token rows in the flattened batch ``[Bd]`` int64.
        slots: cache slots of positions ``0..context_len`` (incl. this step's token),
            padded ``[Bd, S_max]`` int64 (padding points at slot 0).
        valid: ``[Bd, S_max]`` bool, False on padding.
    """

    token_index: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Everything attention needs about one step.

    Attributes:
        positions: ``[T]`` int64 token positions.
        slot_mapping: ``[T]`` int64 cache slot of every computed token.
        prefills: the prefill sequences.
        decode: the decode sequences, or None when there are none.
        logits_index: ``[B]`` int64 row of each sequence's last token.
        cp: this rank's share of a context-parallel step (:mod:`engine.context_parallel`),
            None without CP. With it, every row above is of the FULL step while the model's
            activations hold only ``cp.local_rows``.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefills: tuple[PrefillSeq, ...]
    decode: DecodeBatch | None
    logits_index: torch.Tensor
    cp: CPStep | None = None

    def with_cp(self, cp: CPStep) -> AttentionMetadata:
        """This metadata with ``cp`` set."""
        return replace(self, cp=cp)


def build_attention_metadata(query_lens: list[int], context_lens: list[int],
                             block_tables: list[tuple[int, ...]], block_size: int,
                             device: torch.device | str = "cpu", *,
                             prefill_only: bool = False) -> AttentionMetadata:
    """Metadata of a step from per-sequence query lengths, cached lengths and block tables.

    ``prefill_only``: every sequence is a prefill, 1-token ones included (context parallel).

    Raises:
        ValueError: a sequence has no query tokens, or its block table is too short for
            ``context_len + query_len`` tokens (from :func:`slot_mapping`).
    """
    positions, slots, prefills, dec_rows, dec_slots = [], [], [], [], []
    start = 0
    for qlen, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        if qlen < 1:
            raise ValueError("every sequence in a step needs at least one token to compute")
        seq_slots = slot_mapping(table, 0, ctx + qlen, block_size)  # [ctx + qlen]
        positions.append(torch.arange(ctx, ctx + qlen, dtype=torch.int64))
        slots.append(seq_slots[ctx:])
        if qlen == 1 and ctx > 0 and not prefill_only:
            dec_rows.append(start)
            dec_slots.append(seq_slots)
        else:
            prefills.append(PrefillSeq(start, start + qlen, ctx, seq_slots[:ctx].to(device)))
        start += qlen
    decode = _decode_batch(dec_rows, dec_slots, device) if dec_rows else None
    ends = torch.tensor(query_lens, dtype=torch.int64).cumsum(0) - 1
    return AttentionMetadata(
        positions=torch.cat(positions).to(device), slot_mapping=torch.cat(slots).to(device),
        prefills=tuple(prefills), decode=decode, logits_index=ends.to(device))


def _decode_batch(rows: list[int], seq_slots: list[torch.Tensor],
                  device: torch.device | str) -> DecodeBatch:
    """Pad the decode sequences' slot lists to ``[Bd, S_max]`` with a validity mask."""
    s_max = max(s.shape[0] for s in seq_slots)
    padded = torch.zeros(len(rows), s_max, dtype=torch.int64)
    valid = torch.zeros(len(rows), s_max, dtype=torch.bool)
    for i, s in enumerate(seq_slots):
        padded[i, : s.shape[0]] = s
        valid[i, : s.shape[0]] = True
    return DecodeBatch(torch.tensor(rows, dtype=torch.int64, device=device),
                       padded.to(device), valid.to(device))

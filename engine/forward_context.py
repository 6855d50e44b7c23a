"""Per-step attention metadata: the one object that carries a step's layout to every layer.

A step is a token-flattened batch of T tokens from B sequences; sequence b owns the next
``query_len`` rows, has ``context_len`` tokens cached and computes positions
``context_len .. context_len + query_len - 1``. It is a DECODE sequence when
``query_len == 1 and context_len > 0`` (read in place from block tables by paged attention),
else a PREFILL sequence. The runner builds one :class:`AttentionMetadata` per ``execute`` and
passes it down explicitly; nothing is global.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import accumulate
import torch

from engine.context_parallel import CPStep
from engine.prefill_seq import PrefillSeq


@dataclass(frozen=True)
class SlotSelection:
    """Q queries, each over its own list of cache slots (DeepSeek-V3.2 sparse attention, and
    the padded reference form of a :class:`DecodeBatch`).

    Attributes:
        token_index: the queries' rows in the flattened batch ``[Q]`` int64.
        slots: cache slots each query attends to ``[Q, K]`` int64 (filler entries point at
            any valid slot).
        valid: ``[Q, K]`` bool, False on filler; at least one True per row.
    """

    token_index: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor


@dataclass(frozen=True)
class DecodeBatch:
    """The decode sequences of the step, batched, as block tables (paged attention's input).

    Attributes:
        token_index: their token rows in the flattened batch ``[Bd]`` int64.
        block_table: physical blocks of positions ``0..seq_len-1`` ``[Bd, M]`` int32,
            ``M = max ceil(seq_len / block_size)``; a shorter row is padded with its own last
            block (a valid id, never read unmasked).
        seq_lens: ``[Bd]`` int32 tokens to attend to: ``context_len + 1`` (the cache already
            holds this step's token).
    """

    token_index: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    def padded_slots(self, block_size: int) -> SlotSelection:
        """Every position's slot, padded: ``slots [Bd, M * block_size]`` with ``valid``
        False at and past ``seq_lens`` (the reference / sparse-selection form; tensor ops)."""
        offsets = torch.arange(block_size, device=self.block_table.device)
        slots = (self.block_table.long()[:, :, None] * block_size + offsets).flatten(1)
        pos = torch.arange(slots.shape[1], device=slots.device)
        return SlotSelection(self.token_index, slots, pos[None, :] < self.seq_lens[:, None])


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
        on_kv_written: called with the layer index right after that layer's KV write of
            the step (every buffer: K, V, index keys; on a device, enqueued on the current
            stream, not finished), on the forward's thread; None: nothing is called. The
            prefill worker sends each layer's KV from here (prefill_worker/kv_sends.py).
        prefill_pack: the prefill graph's form of ``prefills`` (then empty): one int64 CPU
            tensor (:func:`engine.prefill_graph.pack_prefills`); None otherwise.
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefills: tuple[PrefillSeq, ...]
    decode: DecodeBatch | None
    logits_index: torch.Tensor
    cp: CPStep | None = None
    on_kv_written: Callable[[int], None] | None = None
    prefill_pack: torch.Tensor | None = None

    def with_cp(self, cp: CPStep) -> AttentionMetadata:
        """This metadata with ``cp`` set."""
        return replace(self, cp=cp)

    def kv_written(self, layer: int) -> None:
        """Layer ``layer`` wrote its KV of the step: tell :attr:`on_kv_written`."""
        if self.on_kv_written is not None:
            self.on_kv_written(layer)


class BlockTableCache:
    """Each request's block table as an int64 tensor, kept from one step to the next.

    NOTE: a block table is fixed for the request's life (all blocks reserved at admission, no
    preemption), so its first step's tensor serves every later one; it is reused only while
    it equals the step's tuple. Entries of requests absent from a step are dropped. Block ids
    must be in ``[0, num_blocks)``.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._tables: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}

    def tensors(self, request_ids: list[str],
                block_tables: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """``[len(table)]`` int64 CPU tensors of ``block_tables``, in order.

        Raises:
            ValueError: a table names a block outside the cache (checked once per table).
        """
        kept: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
        out = []
        for rid, table in zip(request_ids, block_tables, strict=True):
            hit = kept.get(rid) or self._tables.get(rid)
            if hit is None or hit[0] != table:
                hit = (table, self._checked(rid, table))
            kept[rid] = hit
            out.append(hit[1])
        self._tables = kept
        return out

    def _checked(self, request_id: str, table: tuple[int, ...]) -> torch.Tensor:
        ids = torch.tensor(table, dtype=torch.int64)
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.numel():
            raise ValueError(f"request {request_id} has block ids {bad[:4].tolist()} outside "
                             f"this KV cache's {self.num_blocks} blocks: the block table must "
                             "come from this instance's BlockPool")
        return ids


def build_attention_metadata(query_lens: list[int], context_lens: list[int],
                             block_tables: list[tuple[int, ...] | torch.Tensor],
                             block_size: int,
                             device: torch.device | str = "cpu", *,
                             prefill_only: bool = False) -> AttentionMetadata:
    """Metadata of a step from per-sequence query lengths, cached lengths and block tables.

    ``prefill_only``: every sequence is a prefill, 1-token ones included (context parallel).
    ``block_tables``: per sequence a tuple of block ids or a ``[n]`` int64 CPU tensor.

    Raises:
        ValueError: a sequence has no query tokens, or its block table is too short for
            ``context_len + query_len`` tokens.
    """
    used = _blocks_used(query_lens, context_lens, block_tables, block_size)  # per sequence
    ends, first = list(accumulate(query_lens)), [0, *accumulate(used)][:-1]  # [B] each
    flat = _flat_blocks(block_tables, used)  # [sum(used)] the step's blocks, seq by seq
    ends_t, first_t = torch.tensor(ends), torch.tensor(first)
    ctx, q_lens = torch.tensor(context_lens), torch.tensor(query_lens)
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)  # [T] its sequence
    positions = ctx[seq] + torch.arange(seq.shape[0]) - (ends_t - q_lens)[seq]  # [T]
    slots = flat[first_t[seq] + positions // block_size] * block_size + positions % block_size
    is_decode = [q == 1 and c > 0 and not prefill_only for q, c in zip(query_lens, context_lens)]
    prefills = tuple(_prefill_seq(ends[i] - query_lens[i], ends[i], context_lens[i],
                                  flat[first[i]:first[i] + used[i]], block_size, device)
                     for i, dec in enumerate(is_decode) if not dec)
    dec_index = [i for i, dec in enumerate(is_decode) if dec]
    decode = (_decode_batch(torch.tensor(dec_index), ends_t - 1, ctx + 1, flat, first_t,
                            max(used[i] for i in dec_index), block_size, device)
              if dec_index else None)
    return AttentionMetadata(
        positions=positions.to(device), slot_mapping=slots.to(device), prefills=prefills,
        decode=decode, logits_index=(ends_t - 1).to(device))


def _flat_blocks(block_tables: list[tuple[int, ...] | torch.Tensor],
                 used: list[int]) -> torch.Tensor:
    """``[sum(used)]`` int64: the first ``used[i]`` blocks of each table, concatenated."""
    if all(isinstance(table, torch.Tensor) for table in block_tables):
        return torch.cat([table[:n] for table, n in zip(block_tables, used)])
    return torch.cat([table[:n] if isinstance(table, torch.Tensor)
                      else torch.tensor(table[:n], dtype=torch.int64)
                      for table, n in zip(block_tables, used)])


def _blocks_used(query_lens: list[int], context_lens: list[int],
                 block_tables: list[tuple[int, ...] | torch.Tensor],
                 block_size: int) -> list[int]:
    """Blocks each sequence's ``context_len + query_len`` tokens occupy (ValueError as
    :func:`build_attention_metadata` documents)."""
    used = []
    for qlen, ctx, table in zip(query_lens, context_lens, block_tables, strict=True):
        if qlen < 1:
            raise ValueError("every sequence in a step needs at least one token to compute")
        if ctx + qlen > len(table) * block_size:
            raise ValueError(f"token range [0, {ctx + qlen}) does not fit {len(table)} blocks "
                             f"of {block_size}: the scheduler must allocate the step's blocks")
        used.append(-(-(ctx + qlen) // block_size))
    return used


def _prefill_seq(start: int, end: int, context_len: int, table: torch.Tensor, block_size: int,
                 device: torch.device | str) -> PrefillSeq:
    """A prefill sequence of rows ``[start, end)`` whose blocks are ``table [n]`` int64."""
    pos = torch.arange(context_len)
    prefix = table[pos // block_size] * block_size + pos % block_size  # [context_len]
    return PrefillSeq(start, end, context_len, prefix.to(device))


def _decode_batch(index: torch.Tensor, last_rows: torch.Tensor, seq_lens: torch.Tensor,
                  flat: torch.Tensor, first: torch.Tensor, width: int, block_size: int,
                  device: torch.device | str) -> DecodeBatch:
    """The decode sequences ``index [Bd]`` (into the step's sequences) as a
    :class:`DecodeBatch` of ``width`` blocks per row; ``last_rows``, ``seq_lens``, ``first``
    are ``[B]`` per step sequence, ``flat`` the step's blocks."""
    lens = seq_lens[index]  # [Bd]
    last = (lens + block_size - 1) // block_size - 1  # [Bd] each row's last block column
    col = torch.minimum(torch.arange(width)[None, :], last[:, None])  # [Bd, M] pad: last block
    table = flat[first[index][:, None] + col]
    return DecodeBatch(last_rows[index].to(device), table.to(torch.int32).to(device),
                       lens.to(torch.int32).to(device))

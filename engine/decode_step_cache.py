"""Attention metadata of a decode-only step, kept from one step to the next.

In steady decoding the batch is the same requests step after step, each one token further:
what :func:`engine.forward_context.build_attention_metadata` rebuilds from scratch with ~25
small tensor ops per step (per-sequence block counts, the flattened block list, gathers for
positions, slots and the padded ``[B, M]`` block table) changes by little. This cache keeps
the step's :class:`DecodeBatch` block table and its ``[B]`` row indices while the step's
requests are the same, in the same order, and writes only what moved: the rows whose
sequence entered a new block (its new last block, which also pads the row). Per step it makes
three tensors from Python lists (positions, slots, sequence lengths). The result equals
``build_attention_metadata`` for the same step (tests/engine/test_decode_step_cache.py).

NOTE: the cached block table is updated in place between steps. It is safe because a step
is finished (its logits returned, device copies made by a blocking ``.to``) before the next
one is built; nothing else holds the host tensor. Mixed steps (any prefill row), context
parallel and graph padding rows take the general path and reset the cache.
"""

from __future__ import annotations

import torch

from engine.forward_context import AttentionMetadata, DecodeBatch


class DecodeStepCache:
    """The previous decode-only step's block table and row indices (see module docstring).

    Args:
        block_size: tokens per KV block.
        device: where the step's tensors go.
    """

    def __init__(self, block_size: int, device: torch.device | str) -> None:
        self.block_size, self.device = block_size, torch.device(device)
        self._ids: tuple[str, ...] = ()
        self._used: list[int] = []  # blocks each row's sequence occupies
        self._table: torch.Tensor | None = None  # [B, M] int32 host table
        self._rows: torch.Tensor | None = None  # [B] int64 arange on device
        # NOTE: the same values as _rows in another tensor: a graph capture keys on inputs
        # that alias, and the general builder's two tensors do not
        self._last: torch.Tensor | None = None
        self.rebuilds = 0  # tables built from scratch (a new batch or a wider one)

    def reset(self) -> None:
        """Forget the cached batch (the next decode step builds its table anew)."""
        self._ids, self._used, self._table = (), [], None

    def build(self, request_ids: list[str], context_lens: list[int],
              block_tables: list[tuple[int, ...]]) -> AttentionMetadata:
        """The metadata of a decode-only step: sequence b computes one token at position
        ``context_lens[b]`` (> 0) with blocks ``block_tables[b]``.

        Raises:
            ValueError: a block table too short for ``context_len + 1`` tokens (as
                ``build_attention_metadata``).
        """
        bs = self.block_size
        used = []
        for ctx, table in zip(context_lens, block_tables, strict=True):
            if ctx + 1 > len(table) * bs:
                raise ValueError(f"token range [0, {ctx + 1}) does not fit {len(table)} blocks "
                                 f"of {bs}: the scheduler must allocate the step's blocks")
            used.append(ctx // bs + 1)
        self._update_table(tuple(request_ids), used, block_tables)
        slots = [table[ctx // bs] * bs + ctx % bs
                 for ctx, table in zip(context_lens, block_tables)]
        dev = self.device
        positions = torch.tensor(context_lens, dtype=torch.int64).to(dev)  # [B]
        seq_lens = torch.tensor(context_lens, dtype=torch.int32).add_(1).to(dev)  # [B]
        decode = DecodeBatch(self._rows, self._table.to(dev), seq_lens)
        return AttentionMetadata(positions=positions,
                                 slot_mapping=torch.tensor(slots, dtype=torch.int64).to(dev),
                                 prefills=(), decode=decode, logits_index=self._last)

    def _update_table(self, ids: tuple[str, ...], used: list[int],
                      block_tables: list[tuple[int, ...]]) -> None:
        """Make ``_table`` the step's ``[B, M]`` table (``M = max(used)``): rows one block
        further are rewritten from their new last block on; a new batch, a row past ``M`` or
        any other change of a row's block count rebuilds it."""
        table = self._table
        if ids != self._ids or table is None or max(used) > table.shape[1]:
            self._rebuild(ids, used, block_tables)
            return
        grown = [row for row, (now, before) in enumerate(zip(used, self._used)) if now != before]
        if any(used[row] != self._used[row] + 1 for row in grown):
            self._rebuild(ids, used, block_tables)  # NOTE: not one block further (MTP)
            return
        for row in grown:  # NOTE: its new block is the row's last, and its padding
            table[row, used[row] - 1:] = block_tables[row][used[row] - 1]
        self._used = used

    def _rebuild(self, ids: tuple[str, ...], used: list[int],
                 block_tables: list[tuple[int, ...]]) -> None:
        width = max(used)
        rows = [list(t[:u]) + [t[u - 1]] * (width - u) for t, u in zip(block_tables, used)]
        self._table = torch.tensor(rows, dtype=torch.int32)
        if self._rows is None or self._rows.shape[0] != len(ids):
            self._rows = torch.arange(len(ids), dtype=torch.int64).to(self.device)
            self._last = self._rows.clone()
        self._ids, self._used = ids, used
        self.rebuilds += 1

"""The item of a KV transfer: one request's layers of one token range on one pair.

``PrefillKVConnector.send_chunk`` cuts a computed chunk into one :class:`KVChunk` per planned
pair (and, with context-parallel prefill, per token piece); the pair's sender queues it, the
wire header carries it (:class:`~kv_transfer.wire.Header`), and the decode rank's receiver
admits it (:meth:`~kv_transfer.tracker.RequestTracker.admit`) and writes its bytes into
``dst_slots``. Slots are flat cache slots (``block_id * block_size + offset``,
``engine.block_pool.slot_mapping``): row ``s`` of a layer's cache viewed ``[num_blocks *
block_size, *dims]`` on either side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVChunk:
    """Every buffer of ``layers`` for tokens ``[token_start, token_end)`` of one request.

    Attributes:
        request_id: the request.
        layers: layer ids, ascending (the pair's planned layers).
        token_start, token_end: token positions of the request.
        dst_slots: int64 ``[T]`` slots of those tokens in the decode cache (CPU).
        heads: global KV head range ``(start, stop)`` of the pair (GQA), None for MLA.
        src_slots: int64 ``[T]`` slots of those tokens in the prefill cache (on its device);
            the sender's only: not on the wire, None on the decode side.
    """

    request_id: str
    layers: tuple[int, ...]
    token_start: int
    token_end: int
    dst_slots: torch.Tensor = field(compare=False)
    heads: tuple[int, int] | None = None
    src_slots: torch.Tensor | None = field(default=None, compare=False)

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start

    def head_range(self) -> range | None:
        return None if self.heads is None else range(*self.heads)


def runs(*slot_lists: torch.Tensor) -> list[range]:
    """Token offsets of the maximal runs that are consecutive ascending slots in every one of
    ``slot_lists`` (int64 ``[T]`` each, same T > 0): a run ``r`` holds slots ``s[r.start] +
    i`` of each list ``s`` for ``i`` in ``range(len(r))``."""
    first = slot_lists[0].cpu()
    breaks = torch.zeros(first.numel() - 1, dtype=torch.bool)
    for slots in slot_lists:
        s = slots.cpu()
        breaks |= (s[1:] - s[:-1]).ne(1)
    starts = [0] + (breaks.nonzero().flatten() + 1).tolist()
    return [range(a, b) for a, b in zip(starts, starts[1:] + [first.numel()])]

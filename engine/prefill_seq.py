"""One prefill sequence of a step: its rows in the flattened batch and its cached prefix."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

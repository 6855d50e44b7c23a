"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seed.

Maths: temperature scaling, then top-k, then top-p (nucleus, Holtzman et al. 2019,
"The Curious Case of Neural Text Degeneration") over the remaining probabilities, then one
categorical draw. The filtering order matches vLLM's and HF's ``generate`` defaults.

Determinism: the draw for output token ``n`` of a request uses a CPU ``torch.Generator``
seeded with ``(seed, n)``, so the same seed and prompt give the same tokens whatever else
shares the batch, and whichever process samples that token (the prefill side samples token 0,
the decode side the rest). Requests that arrive without a seed get one from
:func:`fill_seed` where they are accepted, so a request is reproducible end to end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        max_tokens: tokens to generate, >= 1.
        temperature: 0 for greedy; > 0 scales logits by 1/temperature.
        top_k: keep the k most likely tokens; 0 keeps all.
        top_p: keep the smallest set with cumulative probability >= top_p; 1.0 keeps all.
        seed: per-request seed, or None.
        ignore_eos: keep going past the EOS token (fixed-length benchmark replay).

    Raises:
        ValueError: on any out-of-range value; the message says the allowed range.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def fill_seed(params: SamplingParams) -> SamplingParams:
    """Return ``params`` with a random seed when it has none (greedy requests unchanged)."""
    if params.greedy or params.seed is not None:
        return params
    return replace(params, seed=int(torch.randint(0, 2**62, (1,)).item()))


def _generator(seed: int, step: int) -> torch.Generator:
    """CPU generator for output token ``step`` of a request seeded ``seed``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + step) % (2**63))
    return gen


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside top-k / top-p with -inf. ``logits``: ``[V]`` fp32."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # NOTE: drop a token when the mass strictly before it already reaches top_p; the
        # most likely token is always kept.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` logits of the last position of each request.
        params: B sampling parameter sets.
        steps: B output indices: how many tokens each request has generated so far.

    Returns:
        B token ids.
    """
    logits = logits.float()
    out: list[int] = []
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    for row, (p, step) in enumerate(zip(params, steps)):
        if p.greedy:
            out.append(int(greedy_ids[row]))
            continue
        gen = _generator(p.seed if p.seed is not None else 0, step)
        scaled = _filter_top_k_top_p(logits[row].cpu() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
    return out

"""Sampling parameters of one request: a plain frozen dataclass.

NOTE: no torch or Ray here: the router and the gRPC client import it
(tests/orchestrator/test_client_imports.py checks the client's import graph).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by a smaller one
# overflows fp32 to inf and the probabilities to NaN.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    Attributes:
        max_tokens: tokens to generate, >= 1.
        temperature: finite, >= 0; below ``SAMPLING_EPS`` (1e-5, 0 included) the request is
            greedy (argmax; top_k, top_p and seed are then unused), else logits are scaled by
            1/temperature (any finite value: a huge one samples nearly uniformly).
        top_k: keep the k most likely tokens; 0 keeps all (a k above the vocabulary keeps
            all).
        top_p: in (0, 1]: keep the smallest set with cumulative probability >= top_p (the
            most likely token always stays); 1.0 keeps all.
        seed: per-request seed in [0, 2**63), or None.
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
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                             f"{self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def fill_seed(params: SamplingParams) -> SamplingParams:
    """Return ``params`` with a random seed in [0, 2**62) when it has none (greedy requests
    unchanged)."""
    if params.greedy or params.seed is not None:
        return params
    return replace(params, seed=secrets.randbelow(2**62))

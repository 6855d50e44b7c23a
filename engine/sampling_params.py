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
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_STOP_TOKEN_IDS = 64
GRAMMAR_KINDS = ("json_schema", "regex", "lark")


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability (natural log) and the ``k`` most likely tokens
    ``(token_id, logprob)``, most likely first (:mod:`engine.logprobs` makes it)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match: ``kind`` "json_schema" (``source`` a JSON Schema, as a JSON
    text), "regex" or "lark" (llguidance's Lark dialect, docs/router.md)."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got "
                             f"{self.kind!r}")
        if not self.source:
            raise ValueError(f"the {self.kind} grammar is empty: give its text")


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
        presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every
            token already generated, once / once per occurrence (OpenAI's formula).
        repetition_penalty: > 0, 1.0 off; logits of tokens in prompt or output are divided by
            it when positive, multiplied when negative (CTRL, Keskar et al. 2019; HF / vLLM).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist.
        stop_token_ids: extra token ids that end the request (finish "stop"), kept in output.
        logprobs: None off; k >= 0: each output token carries its log-probability and the
            k most likely alternatives (at most ``MAX_TOP_LOGPROBS``).
        grammar: the output must match it (:class:`GrammarSpec`), or None.

    Raises:
        ValueError: on any out-of-range value; the message says the allowed range.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        self._check_basic()
        self._check_processing()

    def _check_basic(self) -> None:
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

    def _check_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got "
                             f"{self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(
                t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ids >= 0, "
                             f"got {list(self.stop_token_ids)[:8]}")
        if self.grammar is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot go with a grammar (a complete grammar allows "
                             "only EOS): drop one of them")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.logprobs}")

    @property
    def penalized(self) -> bool:
        """Any penalty is on (the sampler's processing stage runs for this request)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """The logits of this request go through :mod:`engine.logits_process` (penalties,
        min_tokens, grammar); False: the sampler sees the model's logits as they are."""
        return self.penalized or self.min_tokens > 0 or self.grammar is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def fill_seed(params: SamplingParams) -> SamplingParams:
    """Return ``params`` with a random seed in [0, 2**62) when it has none (greedy requests
    unchanged)."""
    if params.greedy or params.seed is not None:
        return params
    return replace(params, seed=secrets.randbelow(2**62))

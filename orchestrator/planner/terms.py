"""The values of the cost model: the :class:`Work` of one forward pass, the :class:`Term` each
cause of time is, and their sum :class:`Cost`.

A term is a kernel's roofline (:func:`roofline`), a collective or a host cost; its phase places
it in a step and the overlap schedule (:mod:`.overlap`) adds the phases up. Work is counted
in the per-token counts of the model's family (:func:`counts_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model_config import ModelConfig
from engine.v4.config import V4Config
from orchestrator.planner import counts, counts_v4
from orchestrator.planner.overlap import (ATTN, COMBINE, DISPATCH, MOE, NONE, PRE, SERIAL,
                                          SHARED, Phases, step_s)


@dataclass(frozen=True)
class Term:
    """One cause of time: ``phase`` places it in a step; ``bound`` says what limits it
    ("compute", "memory", "link", "host")."""

    name: str
    phase: str
    seconds: float
    bound: str


@dataclass(frozen=True)
class Cost:
    """Seconds by cause (module docstring); ``total_s`` per the overlap schedule.

    Attributes:
        terms: the terms, by name (one per name).
        schedule: how the phases add up (:mod:`.overlap`: none, prefill, decode).
        tokens_per_step: tokens a sequence gains per step (MTP: 1 + accepted drafts).
        imbalance: busiest EP rank's routed tokens over the mean.
    """

    terms: tuple[Term, ...]
    schedule: str = NONE
    tokens_per_step: float = 1.0
    imbalance: float = 1.0

    def phase_s(self, phase: str) -> float:
        return sum(t.seconds for t in self.terms if t.phase == phase)

    def bound_s(self, bound: str) -> float:
        return sum(t.seconds for t in self.terms if t.bound == bound)

    @property
    def overlap(self) -> bool:
        """Two micro-batches."""
        return self.schedule != NONE

    @property
    def phases(self) -> Phases:
        return Phases(*(self.phase_s(p) for p in (PRE, ATTN, SHARED, MOE, DISPATCH, COMBINE,
                                                  SERIAL)))

    @property
    def total_s(self) -> float:
        return step_s(self.phases, self.schedule)

    @property
    def compute_s(self) -> float:
        return self.bound_s("compute")

    @property
    def memory_s(self) -> float:
        return self.bound_s("memory")

    @property
    def comm_s(self) -> float:
        return self.bound_s("link")

    @property
    def overhead_s(self) -> float:
        return self.bound_s("host")

    def __add__(self, other: "Cost") -> "Cost":
        names = {t.name: t for t in self.terms}
        for t in other.terms:
            old = names.get(t.name)
            names[t.name] = t if old is None else replace(old, seconds=old.seconds + t.seconds)
        return replace(self, terms=tuple(names.values()))


@dataclass(frozen=True)
class Work:
    """What one forward pass of a DP rank does: ``tokens`` through the linears,
    ``attn_flops`` attention-core FLOPs reading ``kv_bytes``, ``lm_rows`` rows through
    lm_head; ``decode``: decode kernels (attention efficiency, low-latency all-to-all);
    ``prefix_flops``: prefill's re-expansion of the prefix latents to per-head K/V
    (:func:`.counts.prefix_up_flops`), at the linears' rate; ``mha_keys``: a prefill in
    MHA form (causal, per-head keys): the keys a query sees on average, which sets the
    attention kernel's rate (:meth:`.hardware.Hardware.attn_flops`; 0: absorbed / sparse form)."""

    tokens: float
    attn_flops: float
    kv_bytes: float
    lm_rows: float
    decode: bool
    prefix_flops: float = 0.0
    mha_keys: float = 0.0

    def half(self) -> "Work":
        """One of two micro-batches: half the tokens of the same prompts (the keys a query
        sees unchanged)."""
        return Work(self.tokens / 2, self.attn_flops / 2, self.kv_bytes / 2,
                    self.lm_rows / 2, self.decode, self.prefix_flops / 2, self.mha_keys)


def counts_for(m: ModelConfig | V4Config):
    """The per-token counts of ``m``'s family: :mod:`.counts_v4` for DeepSeek-V4, else
    :mod:`.counts` (same function names and units)."""
    return counts_v4 if isinstance(m, V4Config) else counts


def roofline(name: str, phase: str, flops: float, rate: float, nbytes: float,
             bw: float) -> Term:
    """The time of a kernel doing ``flops`` FLOPs at ``rate`` FLOP/s and moving ``nbytes``
    bytes at ``bw`` bytes/s: the larger of the two, bound by the one that takes it."""
    c, m = flops / rate, nbytes / bw
    return Term(name, phase, max(c, m), "compute" if c >= m else "memory")

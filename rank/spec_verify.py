"""The leader's half of a speculative step: verify each sequence's drafts against the main
model's logits (:func:`engine.spec_decode.verify`), keep what a request may keep (up to its
first EOS), remember what its next step drafts from, and count drafts made and kept."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from engine.sampling import RowFailure
from engine.scheduler import SchedulerOutput
from engine.spec_decode import DraftInput, SpecOutput, cut_at_stop, verify


@dataclass
class SpecStats:
    """Speculative decoding counters of one instance since start.

    Attributes:
        steps: verify steps of sequences that had drafts. drafted: drafts made.
        accepted: drafts kept. emitted: tokens those steps emitted (kept drafts + 1 each).
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, drafted: int, accepted: int, emitted: int) -> None:
        with self._lock:
            self.steps += 1
            self.drafted += drafted
            self.accepted += accepted
            self.emitted += emitted

    def snapshot(self) -> tuple[float, float]:
        """(acceptance rate = accepted / drafted, mean accepted length = emitted tokens per
        verify step); (0, 0) before any draft."""
        with self._lock:
            if not self.drafted:
                return 0.0, 0.0
            return self.accepted / self.drafted, self.emitted / self.steps


@dataclass(frozen=True)
class Verified:
    """A speculative step's tokens: as ``StepResult``'s sampled / accepted / failed."""

    sampled: dict[str, int]
    accepted: dict[str, tuple[int, ...]]
    failed: dict[str, str]


def verify_step(name: str, out: SchedulerOutput, spec: SpecOutput,
                eos_token_ids: frozenset[int], stats: SpecStats) -> Verified:
    """Tokens of every chunk of ``out`` that completes; sets each such request's
    ``draft`` (its next step's :class:`DraftInput`). ``name``: the instance (errors)."""
    sampled: dict[str, int] = {}
    accepted: dict[str, tuple[int, ...]] = {}
    failed: dict[str, str] = {}
    for i, chunk in enumerate(out.chunks):
        if not chunk.completes:
            continue
        req, drafts = chunk.request, spec.drafts[i]
        params = req.spec.sampling
        tokens = verify(spec.logits[spec.rows(i)], drafts, params, len(req.output_token_ids))
        if isinstance(tokens, RowFailure):
            failed[req.request_id] = f"{name}: {tokens.reason}"
            continue
        tokens = cut_at_stop(tokens, eos_token_ids, params)
        if drafts:
            kept = sum(1 for a, b in zip(drafts, tokens[:-1]) if a == b)
            stats.record(len(drafts), kept, len(tokens))
        sampled[req.request_id] = tokens[-1]
        if len(tokens) > 1:
            accepted[req.request_id] = tuple(tokens[:-1])
        # NOTE: rows chunk.end - 1 .. + len(tokens) - 1 now have their next token known
        req.draft = DraftInput(spec.hidden[i][:len(tokens)], chunk.end - 1, tuple(tokens))
    return Verified(sampled, accepted, failed)

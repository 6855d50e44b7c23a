"""The leader's half of a speculative step: process each sequence's rows as plain decoding
would (penalties, min_tokens, grammar: each row sees the drafts before it as output), verify
its drafts against the main model's logits (:func:`engine.spec_decode.verify`), keep what a
request may keep (up to its first stop), record logprobs, remember what its next step drafts
from, and count drafts made and kept."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine.logits_process import LogitsStage, MaskJob
from engine.logprobs import token_logprobs
from engine.request import Request
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
                eos_token_ids: frozenset[int], stats: SpecStats,
                stage: LogitsStage | None = None, job: MaskJob | None = None,
                early: dict[int, str] | None = None) -> Verified:
    """Tokens of every chunk of ``out`` that completes; sets each such request's
    ``draft`` (its next step's :class:`DraftInput`). ``name``: the instance (errors).

    ``stage``/``job``/``early``: the logits stage, the step's grammar masks and the grammar
    failures of :meth:`LogitsStage.begin` over the completing chunks' requests (row b = the
    b-th completing chunk): a request that asks for processing has each of its rows
    processed as plain decoding would (:meth:`LogitsStage.apply_drafts`) before
    verification, and one that asks for logprobs gets one entry per emitted token, from the
    row that emitted it.
    """
    sampled: dict[str, int] = {}
    accepted: dict[str, tuple[int, ...]] = {}
    failed: dict[str, str] = {}
    completing = [i for i, chunk in enumerate(out.chunks) if chunk.completes]
    for row, i in enumerate(completing):
        req, drafts = out.chunks[i].request, spec.drafts[i]
        params = req.spec.sampling
        logits = spec.logits[spec.rows(i)]  # [1 + j, V]
        why = (early or {}).get(row) or _process(stage, logits, req, drafts, job, row)
        tokens = RowFailure(why) if why else \
            verify(logits, drafts, params, len(req.output_token_ids))
        if isinstance(tokens, RowFailure):
            failed[req.request_id] = f"{name}: {tokens.reason}"
            continue
        tokens = cut_at_stop(tokens, eos_token_ids, params)
        if drafts:
            kept = sum(1 for a, b in zip(drafts, tokens[:-1]) if a == b)
            stats.record(len(drafts), kept, len(tokens))
        if params.logprobs is not None:
            req.output_logprobs.extend(token_logprobs(logits[r].float(), t, params)
                                       for r, t in enumerate(tokens))
        sampled[req.request_id] = tokens[-1]
        if len(tokens) > 1:
            accepted[req.request_id] = tuple(tokens[:-1])
        # NOTE: rows chunk.end - 1 .. + len(tokens) - 1 now have their next token known
        req.draft = DraftInput(spec.hidden[i][:len(tokens)], out.chunks[i].end - 1,
                               tuple(tokens))
    return Verified(sampled, accepted, failed)


def _process(stage: LogitsStage | None, logits: torch.Tensor, req: Request,
             drafts: tuple[int, ...], job: MaskJob | None, row: int) -> str | None:
    """Penalties / min_tokens / grammar of ``req`` on its rows ``logits [1 + j, V]`` in
    place (none asked: untouched); why it cannot be sampled, else None."""
    if not req.spec.sampling.processed:
        return None
    if stage is None:
        return "this instance has no logits stage for penalties / grammars"
    with torch.inference_mode():  # NOTE: the step's logits are inference tensors
        return stage.apply_drafts(logits, req, drafts, job, row)

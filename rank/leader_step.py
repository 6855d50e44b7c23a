"""One leader step: schedule -> execute (all ranks) -> sample -> update, with a typed
:class:`SchedulerOutput` between the stages and a :class:`StepResult` out of it.

Isolation: a request can only ever fail itself. A row the sampler cannot sample fails its
request alone (``StepResult.failed``). A step that raises for any reason but a rank failure
is run again one chunk at a time: a chunk that fails alone fails its request, the others go on
with the tokens a clean step gives them (each chunk recomputes the same KV into the same
slots; on prefill a recomputed chunk's KV may be sent twice, which the decode side counts once:
it marks (layer, token) cells, see kv_transfer/tracker.py).

Lockstep (``ep`` with several DP ranks, rank/dp_sync.py): a role's step asks
:meth:`LeaderStep.agree` before taking the leader's lock; when the round runs, :meth:`run`
runs a forward on every rank even with nothing scheduled (an empty one), and each chunk re-run
of a failed step opens a round of its own, so the other DP ranks meet every forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.error_text import first_line
from engine.logits_process import LogitsStage, MaskJob
from engine.logprobs import token_logprobs
from engine.sampling import RowFailure, sample
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import SpecOutput
from rank.spec_verify import SpecStats, verify_step
from rank.dp_sync import DPGroupBroken, DPSync
from rank.failures import RankFailure
from rank.spmd import SPMDGroup

log = logging.getLogger(__name__)

# Makes a role's per-step inputs (every rank's ``after_step`` receives them) from the step.
StepInputsFor = Callable[[SchedulerOutput], Any]


@dataclass(frozen=True)
class StepResult:
    """What one leader step did.

    Attributes:
        output: what the scheduler scheduled (the step's chunks).
        sampled: request id -> the token sampled for it this step (requests whose chunk
            reached their last known token; may be empty).
        failed: request id -> why that request failed this step (its row could not be
            sampled, or its chunk failed alone); the role ends each with an error event.
        accepted: speculative decoding: request id -> the drafts it kept this step, which
            come before its ``sampled`` token (absent: none).
    """

    output: SchedulerOutput
    sampled: dict[str, int]
    failed: dict[str, str]
    accepted: dict[str, tuple[int, ...]] = field(default_factory=dict)


class LeaderStep:
    """The step of one leader.

    Args:
        name: the instance's name (error messages).
        scheduler: the leader's scheduler.
        group: the instance's ranks (runs each step on all of them).
        dp_sync: the role's DP sync (``ep`` with ``dp > 1``), else None.
        logits_stage: per-request processing before sampling (penalties, min_tokens,
            grammar; :mod:`engine.logits_process`), or None (no request may ask for any).
    """

    def __init__(self, name: str, scheduler: Scheduler, group: SPMDGroup,
                 dp_sync: DPSync | None, logits_stage: LogitsStage | None = None,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.name, self.scheduler, self.group, self.dp_sync = name, scheduler, group, dp_sync
        self.logits_stage = logits_stage
        self.timer = group.timer
        self.eos_token_ids = eos_token_ids
        self.spec_stats = SpecStats()  # speculative decoding: drafts made and kept

    def close(self) -> None:
        """Release the logits stage's worker thread."""
        if self.logits_stage is not None:
            self.logits_stage.close()

    def leave(self) -> None:
        """The loop ended: leave the DP lockstep (:meth:`rank.dp_sync.DPSync.leave`; nothing
        without one)."""
        if self.dp_sync is not None:
            self.dp_sync.leave()

    def agree(self) -> bool:
        """Before the role's step takes the lock: whether this iteration may run a forward.
        True without a DP sync (:meth:`run` runs one only when it schedules something); with
        one, True when any DP rank of the role has queued or running requests, and then
        :meth:`run` runs a forward whatever it schedules.

        Raises:
            DPGroupBroken: another DP rank did not meet the round (a :class:`RankFailure`).
        """
        if self.dp_sync is None:
            return True
        # NOTE: read without the lock: a request queued right after this read runs in this
        # round if some DP rank has work, else in the next (enqueue sets the wake event).
        return self.dp_sync.any_work(bool(self.scheduler.running or self.scheduler.waiting))

    def run(self, step_inputs_for: StepInputsFor | None = None) -> StepResult | None:
        """schedule -> execute on all ranks -> sample -> update; None when nothing ran.
        ``step_inputs_for(output)`` makes the role's per-step inputs that every rank's
        ``after_step`` receives (prefill: the chunks' KV transfers). A step that raises is run
        again chunk by chunk (module docstring). Caller holds the leader's lock and got True
        from :meth:`agree`: in a lockstep round with nothing scheduled, an empty forward runs
        on every rank (a result with no chunks).

        Raises:
            RankFailure: a rank died or hung, or another DP rank did not meet a round (the
                loop takes the instance out of service).
        """
        with self.timer.phase("schedule"):
            out = self.scheduler.schedule()
        if not out:
            if self.dp_sync is None:
                return None
            self._run_empty()
            return StepResult(out, {}, {})
        try:
            return self._execute(out, step_inputs_for)
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated below
            return self._execute_each(out, step_inputs_for, exc)

    def _execute(self, out: SchedulerOutput,
                 step_inputs_for: StepInputsFor | None) -> StepResult:
        """execute ``out`` on all ranks -> sample -> update the counters."""
        step_inputs = step_inputs_for(out) if step_inputs_for else None
        rows = [i for i, c in enumerate(out.chunks) if c.completes]
        reqs = [out.chunks[i].request for i in rows]
        # NOTE: grammar masks are computed while the forward runs
        job, early = self.logits_stage.begin(reqs) if self.logits_stage else (None, {})
        try:
            logits = self.group.run_step(out.steps, step_inputs)
        except BaseException:
            if job is not None:
                job.settle()
            raise
        if isinstance(logits, SpecOutput):
            with self.timer.phase("sample"):
                verified = verify_step(self.name, out, logits, self.eos_token_ids,
                                       self.spec_stats, self.logits_stage, job, early)
            with self.timer.phase("schedule"):
                self.scheduler.update(out, verified.sampled, verified.accepted)
            return StepResult(out, verified.sampled, verified.failed, verified.accepted)
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        if rows:
            # NOTE: every row samples on decode: no [B, V] copy then
            picked = logits if len(rows) == logits.shape[0] else logits[rows]
            with self.timer.phase("sample"):
                tokens = self._sample(picked, reqs, job, early)
            for req, token in zip(reqs, tokens):
                if isinstance(token, RowFailure):
                    failed[req.request_id] = f"{self.name}: {token.reason}"
                else:
                    sampled[req.request_id] = token
        with self.timer.phase("schedule"):
            self.scheduler.update(out, sampled)
        return StepResult(out, sampled, failed)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], job: MaskJob | None,
                early: dict[int, str]) -> list[int | RowFailure]:
        """Process (requests that ask; ``job``: their grammar masks, ``early``: rows whose
        grammar already failed), sample, and record logprobs (requests that ask) of
        ``logits [B, V]``, row b for ``reqs[b]``."""
        params = [r.spec.sampling for r in reqs]
        failures = dict(early)
        if any(p.processed for p in params):
            if self.logits_stage is None:
                raise ValueError(f"{self.name} has no logits stage for penalties / grammars")
            logits = logits.float()
            # NOTE: in place on the step's logits (an inference tensor): no copy, so rows of
            # requests without processing cost nothing
            with torch.inference_mode():
                failures.update(self.logits_stage.apply(logits, reqs, job))
        tokens = sample(logits, params, [r.sampling_step for r in reqs])
        for row, why in failures.items():
            tokens[row] = RowFailure(why)
        for row, (req, token) in enumerate(zip(reqs, tokens)):
            if req.spec.sampling.logprobs is not None and isinstance(token, int):
                req.output_logprobs.append(
                    token_logprobs(logits[row].float(), token, req.spec.sampling))
        return tokens

    def _execute_each(self, out: SchedulerOutput, step_inputs_for: StepInputsFor | None,
                      error: Exception) -> StepResult:
        """After ``out`` raised ``error``: run each chunk alone; one that fails again fails
        its request only.

        Raises:
            RankFailure: a rank died or hung meanwhile.
        """
        log.warning("%s: a step of %d request(s) failed (%s)%s", self.name,
                    len(out.chunks), first_line(error),
                    "; running each alone"
                    if len(out.chunks) > 1 or self.dp_sync is not None else "")
        # NOTE: with a DP sync even one chunk runs again: its round tells a broken EP group
        # (DPGroupBroken: out of service, requests retryable) from a bad request
        if len(out.chunks) == 1 and self.dp_sync is None:
            return StepResult(out, {}, {out.chunks[0].request.request_id:
                                        self._step_error(error)})
        sampled: dict[str, int] = {}
        failed: dict[str, str] = {}
        accepted: dict[str, tuple[int, ...]] = {}
        for chunk in out.chunks:
            if self.dp_sync is not None:
                # NOTE: under the lock, like the forward itself: one round per re-run forward
                self.dp_sync.any_work(True)
            try:
                solo = self._execute(SchedulerOutput((chunk,), out.speculative),
                                     step_inputs_for)
            except RankFailure:
                raise
            except Exception as exc:  # noqa: BLE001 - this chunk fails alone: its request
                failed[chunk.request.request_id] = self._step_error(exc)
                continue
            sampled.update(solo.sampled)
            failed.update(solo.failed)
            accepted.update(solo.accepted)
        return StepResult(out, sampled, failed, accepted)

    def _step_error(self, exc: Exception) -> str:
        return f"{self.name}: the model step failed for this request: {first_line(exc)}"

    def _run_empty(self) -> None:
        """An empty forward on every rank (a lockstep round with nothing scheduled here).

        Raises:
            RankFailure: a rank died or hung; DPGroupBroken: the forward failed (with no
                request in it, only the role's collectives can have failed).
        """
        try:
            self.group.run_step([])
        except RankFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - no request to blame: the EP group broke
            raise DPGroupBroken(f"{self.name}: an empty lockstep forward failed: "
                                f"{first_line(exc)}") from exc

"""Speculative decoding, the leader's side: what a sequence drafts from, what a step returns,
and the verification of drafts against the main model (greedy, or rejection sampling).

A step of a speculating sequence whose last token ``t_n`` (position n) is not yet cached
computes positions ``n .. n + j`` over ``[t_n, d_1 .. d_j]`` (the j drafts the MTP module made
on every rank at the start of the same step, :mod:`engine.spec_forward`) and returns the main
model's logits at those j + 1 rows. :func:`verify` turns them into tokens:

- greedy: the longest prefix of drafts equal to the argmax at their rows, then the argmax at
  the first row that differs (or at the last row): exactly the tokens plain greedy decoding
  gives.
- sampling (temperature, top-k, top-p as :mod:`engine.sampling`): standard speculative
  sampling (Leviathan et al. 2023, Chen et al. 2023) with a deterministic draft, i.e. a
  one-hot draft distribution: draft ``d`` at a row whose target distribution is ``p`` is kept
  with probability ``p(d)``; when it is not, the row's token is drawn from ``p`` with ``d``
  removed and renormalized, and the step ends there; when every draft is kept one more token
  is drawn from the last row. Each output token then has exactly the distribution plain
  sampling gives (tests/engine/test_spec_decode.py checks it by a chi-square test). The draws
  of output token ``n`` use the request's generator seeded ``(seed, n)``, so a seed fixes the
  tokens, but they differ from the tokens plain sampling with the same seed draws.

KV of rows past the kept tokens is not freed: the request's counters stop before them and
the next step overwrites them (blocks are reserved for the request's life, plus k slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import (RowFailure, _filter_top_k_top_p, _finite_after_mask, _generator,
                             greedy_argmax)
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class DraftInput:
    """What the MTP module drafts from at a sequence's next step.

    Attributes:
        hidden: ``[m, hidden]`` the main model's normed last hidden states at positions
            ``start .. start + m - 1`` (kept on the leader between steps).
        start: position of ``hidden[0]``; the MTP KV cache holds positions ``< start``.
        token_ids: the m tokens at positions ``start + 1 .. start + m`` (the last one is the
            sequence's newest token, not yet cached).
    """

    hidden: torch.Tensor
    start: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SpecOutput:
    """A speculative step's result (the runner's return value with speculation on).

    Attributes:
        logits: ``[R, vocab]`` fp32, ``1 + len(drafts[b])`` rows per sequence, in step order:
            the main model's logits at each computed row of a speculating sequence (the last
            one for a prefill chunk).
        drafts: per sequence the draft tokens it verified (empty: none).
        hidden: per sequence ``[1 + len(drafts[b]), hidden]`` normed main hidden states of the
            rows ``logits`` has (the next step's :class:`DraftInput` is cut from them).
    """

    logits: torch.Tensor
    drafts: tuple[tuple[int, ...], ...]
    hidden: tuple[torch.Tensor, ...]

    def rows(self, seq: int) -> slice:
        """Rows of ``logits`` of sequence ``seq``."""
        start = sum(1 + len(d) for d in self.drafts[:seq])
        return slice(start, start + 1 + len(self.drafts[seq]))


def verify(logits: torch.Tensor, drafts: tuple[int, ...], params: SamplingParams,
           step: int) -> list[int] | RowFailure:
    """The tokens one speculating sequence emits this step (module docstring).

    Args:
        logits: ``[j + 1, vocab]`` main-model logits at the sequence's rows, processed per
            row when the request asks (``LogitsStage.apply_drafts``; -inf: masked tokens).
        drafts: the j draft tokens (row i verifies ``drafts[i]``).
        params: the request's sampling parameters. step: tokens it generated so far.

    Returns:
        1 to j + 1 token ids (kept drafts, then one from the main model), or a
        :class:`RowFailure` (non-finite logits or probabilities).
    """
    logits = logits.float()
    if not bool(torch.isfinite(logits.sum())) and \
            not all(_finite_after_mask(row) for row in logits):
        return RowFailure("the model produced non-finite logits (inf/NaN) for this request")
    if params.greedy:
        best = greedy_argmax(logits).tolist()  # [j + 1]
        kept = 0
        while kept < len(drafts) and drafts[kept] == best[kept]:
            kept += 1
        return [*drafts[:kept], best[kept]]
    try:
        return _rejection_sample(logits, drafts, params, step)
    except Exception as exc:  # noqa: BLE001 - one row's failure is that request's alone
        return RowFailure(f"speculative sampling raised {type(exc).__name__}: {exc}")


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[vocab]`` logits of one row -> the distribution plain sampling draws from
    (temperature, top-k, top-p of :mod:`engine.sampling`)."""
    scaled = _filter_top_k_top_p(logits.cpu() / params.temperature, params.top_k,
                                 params.top_p)
    return torch.softmax(scaled, dim=-1)


def _rejection_sample(logits: torch.Tensor, drafts: tuple[int, ...], params: SamplingParams,
                      step: int) -> list[int] | RowFailure:
    """Speculative sampling with one-hot drafts (module docstring)."""
    gen = _generator(params.seed if params.seed is not None else 0, step)
    out: list[int] = []
    for row, draft in enumerate((*drafts, None)):
        probs = target_probs(logits[row], params)  # [V]
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return RowFailure(f"sampling probabilities are not finite at temperature "
                              f"{params.temperature:g}, top_k {params.top_k}, "
                              f"top_p {params.top_p:g}")
        if draft is not None:
            keep = float(probs[draft])
            if float(torch.rand((), generator=gen)) < keep:
                out.append(draft)
                continue
            probs = probs.clone()
            probs[draft] = 0.0  # NOTE: max(0, p - onehot(d)), renormalized by multinomial
        out.append(int(torch.multinomial(probs, 1, generator=gen).item()))
        return out
    return out


def cut_at_stop(tokens: list[int], eos_token_ids: frozenset[int],
                params: SamplingParams) -> list[int]:
    """``tokens`` up to and including the first that stops the request (an EOS id unless
    ``ignore_eos``, or one of ``stop_token_ids``, as ``engine.scheduler.finish_reason``):
    what a request keeps of one step's tokens."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_token_ids)
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i + 1]
    return tokens


__all__ = ["DraftInput", "SpecOutput", "cut_at_stop", "target_probs", "verify"]

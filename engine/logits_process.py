"""The sampler's per-request processing stage: penalties, ``min_tokens`` and the grammar mask,
applied to the rows of the requests that ask for any (``SamplingParams.processed``) before
:func:`engine.sampling.sample` draws. Rows of other requests are not touched (no copy, no
pass over them): batch mates without a grammar or penalty pay nothing.

Maths, per row ``x [V]`` (vLLM's order): repetition penalty ``r`` on every token seen in prompt
or output (``x / r`` where ``x > 0``, else ``x * r``; CTRL, Keskar et al. 2019), then
``x -= frequency_penalty * count + presence_penalty * (count > 0)`` over output tokens
(OpenAI's formula), then ``-inf`` on EOS and ``stop_token_ids`` while fewer than
``min_tokens`` tokens exist, then ``-inf`` on every token the grammar forbids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.grammar import GrammarCompiler
from engine.request import Request


class LogitsStage:
    """Applies the processing of each request to its row, in place.

    Args:
        eos_token_ids: the model's EOS ids (masked under ``min_tokens``).
        tokenizer_json: the checkpoint's tokenizer.json, for grammars (None: a grammar request
            fails with a message saying so). The grammar compiler is built on the first
            grammar request (~1 s), with the logits' width as vocabulary size.
    """

    def __init__(self, eos_token_ids: frozenset[int], tokenizer_json: str | None) -> None:
        self.eos_token_ids, self.tokenizer_json = eos_token_ids, tokenizer_json
        self.grammars: GrammarCompiler | None = None

    def apply(self, logits: torch.Tensor, reqs: Sequence[Request]) -> dict[int, str]:
        """Process ``logits [B, V]`` fp32 in place, row ``b`` for ``reqs[b]``; returns
        row -> why that row cannot be sampled (a grammar that failed): that request fails."""
        failures: dict[int, str] = {}
        for row, req in enumerate(reqs):
            if not req.spec.sampling.processed:
                continue
            try:
                why = self._apply_row(logits[row], req)
            except Exception as exc:  # noqa: BLE001 - one request's grammar fails it alone
                why = f"the logits processing raised {type(exc).__name__}: {exc}"
            if why is not None:
                failures[row] = why
        return failures

    def _apply_row(self, x: torch.Tensor, req: Request) -> str | None:
        """``x [V]`` of one request, in place; returns why it failed, or None."""
        p = req.spec.sampling
        out = req.generated_token_ids
        if p.penalized:
            apply_penalties(x, req.original_prompt_token_ids, out, p.repetition_penalty,
                            p.frequency_penalty, p.presence_penalty)
        if len(out) < p.min_tokens:
            banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < x.numel()]
            x[banned] = float("-inf")
        if p.grammar is None:
            return None
        if req.grammar is None:
            if self.tokenizer_json is None:
                return "this instance cannot apply grammars (no tokenizer.json)"
            if self.grammars is None:
                self.grammars = GrammarCompiler(self.tokenizer_json, x.numel(),
                                                tuple(sorted(self.eos_token_ids)))
            req.grammar = self.grammars.start(p.grammar)
        why = req.grammar.catch_up(out)
        if why is None:
            apply_allowed(x, req.grammar.allowed())
        return why


def apply_allowed(x: torch.Tensor, allowed: bytes) -> None:
    """``-inf`` on the tokens of ``x [V]`` not allowed (``allowed``: a byte per token id,
    non-zero = allowed; ids past its end are not allowed)."""
    n = len(allowed)
    keep = torch.frombuffer(bytearray(allowed), dtype=torch.uint8) != 0  # [n]
    x[:n].masked_fill_(~keep, float("-inf"))
    x[n:] = float("-inf")


def apply_penalties(x: torch.Tensor, prompt: Sequence[int], output: Sequence[int],
                    repetition: float, frequency: float, presence: float) -> None:
    """Penalize ``x [V]`` fp32 in place (module docstring's formulas)."""
    vocab = x.numel()
    if repetition != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt, *output) if t < vocab}),
                            dtype=torch.long)
        if seen.numel():
            vals = x[seen]
            x[seen] = torch.where(vals > 0, vals / repetition, vals * repetition)
    if (frequency or presence) and output:
        counts = torch.bincount(torch.tensor([t for t in output if t < vocab],
                                             dtype=torch.long), minlength=vocab)[:vocab]
        x -= frequency * counts.to(x.dtype) + presence * (counts > 0).to(x.dtype)

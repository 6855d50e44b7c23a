"""Log-probabilities of sampled tokens, on the distribution the sampler drew from.

That distribution is ``log_softmax(x / T)`` of the processed logits ``x`` (penalties and
grammar mask applied, :mod:`engine.logits_process`) at the request's temperature ``T``
(``T = 1`` for greedy requests), before top-k / top-p truncation (as vLLM's processed
logprobs; a truncated distribution would give -inf to the alternatives clients ask for).
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams, TokenLogprobs


def token_logprobs(x: torch.Tensor, token: int, params: SamplingParams) -> TokenLogprobs:
    """:class:`TokenLogprobs` of ``token`` under row ``x [V]`` fp32 (processed logits)."""
    scale = 1.0 if params.greedy else params.temperature
    logp = torch.log_softmax(x / scale, dim=-1)  # [V]
    k = params.logprobs or 0
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, ids = torch.topk(logp, k)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprobs(token, float(logp[token]), top)

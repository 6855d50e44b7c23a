"""The sampler: greedy, temperature, top-k, top-p, per-request seed.

Maths: temperature, then top-k, then top-p (nucleus, Holtzman et al. 2019) over the remaining
probabilities, then one categorical draw; the order of vLLM and HF ``generate``. NOTE: output
token ``n`` of a request is drawn with a CPU generator seeded ``(seed, n)``, so a seed gives
the same tokens whatever shares the batch and whichever side samples (prefill samples token
0); unseeded requests get a seed where they are accepted (``sampling_params.fill_seed``).
Each row is sampled on its own: NaN or +inf logits (or -inf everywhere), non-finite
probabilities, or a draw that raises, give a :class:`RowFailure` and only that request fails;
-inf is a masked token (:mod:`engine.logits_process`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RowFailure:
    """Why one row could not be sampled (``reason``); only that row's request fails."""

    reason: str


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
        # most likely token is always kept (also when top_p rounds to 0 in fp32).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


_ARGMAX_CHUNK = 256


def greedy_argmax(logits: torch.Tensor, chunk_max: torch.Tensor | None = None) -> torch.Tensor:
    """Index of each row's largest logit, the first one on ties: ``torch.argmax(logits, -1)``.

    ``logits [B, V]`` -> ``[B]`` int64. On CPU: max per chunk of ``_ARGMAX_CHUNK`` logits
    (vectorized; ``chunk_max`` when the caller has it from :func:`chunk_maxima`), then the
    first max inside the first best chunk (~10x faster than argmax at ``[8, 129280]``).
    NOTE: a row holding NaN gives an index in a NaN's chunk (:func:`sample` fails such rows
    first).
    """
    rows, vocab = logits.shape
    if vocab // _ARGMAX_CHUNK < 2 or logits.device.type != "cpu":
        return torch.argmax(logits, dim=-1)
    if chunk_max is None:
        chunk_max = chunk_maxima(logits)
    start = chunk_max.argmax(dim=-1) * _ARGMAX_CHUNK  # [B]
    cols = start[:, None] + torch.arange(_ARGMAX_CHUNK, device=logits.device)  # [B, chunk]
    inside = logits.gather(1, cols.clamp(max=vocab - 1))
    # NOTE: the last chunk may be short: its columns past the vocabulary (clamped onto the
    # last one above) must never win.
    inside = inside.masked_fill(cols >= vocab, float("-inf"))
    return start + inside.argmax(dim=-1)


def chunk_maxima(logits: torch.Tensor) -> torch.Tensor:
    """``[B, ceil(V / _ARGMAX_CHUNK)]``: the max of each chunk of ``_ARGMAX_CHUNK`` logits of
    ``logits [B, V]`` (NaN where a chunk holds one: ``amax`` propagates NaN)."""
    rows, vocab = logits.shape
    chunks = vocab // _ARGMAX_CHUNK
    whole = chunks * _ARGMAX_CHUNK
    chunk_max = logits[:, :whole].reshape(rows, chunks, _ARGMAX_CHUNK).amax(dim=-1)
    if whole < vocab:
        chunk_max = torch.cat([chunk_max, logits[:, whole:].amax(dim=-1, keepdim=True)], -1)
    return chunk_max


def sample(logits: torch.Tensor, params: list[SamplingParams],
           steps: list[int]) -> list[int | RowFailure]:
    """One token id (or :class:`RowFailure`) per row of ``logits [B, V]``; ``steps[b]``:
    tokens request b has generated so far (seeds its draw)."""
    logits = logits.float()
    greedy_ids, finite = greedy_and_finite(logits)
    out: list[int | RowFailure] = []
    for row, (p, step) in enumerate(zip(params, steps)):
        if not finite[row]:
            out.append(RowFailure("the model produced non-finite logits (inf/NaN) for this "
                                  "request"))
        elif p.greedy:
            out.append(greedy_ids[row])
        else:
            out.append(_sample_row(logits[row], p, step))
    return out


def greedy_and_finite(logits: torch.Tensor) -> tuple[list[int], list[bool]]:
    """``logits [B, V]`` fp32 -> (each row's ``torch.argmax``, whether the row can be
    sampled: no NaN, no +inf and some finite logit; -inf is a masked token), read to the host
    in ONE copy (a ``[2, B]`` tensor). NOTE: a row that fails the check has an undefined id.

    On CPU the ``[B, V]`` logits are read once for both (:func:`chunk_maxima`: a row's max is
    finite iff the row passes); elsewhere ``argmax`` and one sum per row (a row holding any
    inf or NaN has a non-finite sum, inf - inf being NaN; finite logits would need
    ``|x| ~ 1e33`` to overflow it), rows with a non-finite sum checked again one by one (a
    masked row's -inf alone is fine).
    """
    if logits.device.type == "cpu" and logits.shape[1] // _ARGMAX_CHUNK >= 2:
        chunk_max = chunk_maxima(logits)
        ok = torch.isfinite(chunk_max.amax(dim=-1))  # [B]
        ids = greedy_argmax(logits, chunk_max)
        checked = True
    else:
        ok = torch.isfinite(logits.sum(dim=-1))  # [B]
        ids = torch.argmax(logits, dim=-1)
        checked = False
    ids_host, ok_host = torch.stack([ids, ok.to(ids.dtype)]).tolist()  # NOTE: one sync
    finite = [bool(v) for v in ok_host]
    if not checked:
        for row in [r for r, v in enumerate(finite) if not v]:
            finite[row] = _finite_after_mask(logits[row])
    return ids_host, finite


def _finite_after_mask(row: torch.Tensor) -> bool:
    """``row [V]`` holds no NaN and no +inf, and some finite logit (-inf: a token the logits
    stage masked, :mod:`engine.logits_process`)."""
    return not bool(torch.isnan(row).any()) and bool(torch.isfinite(row.max()))


def _sample_row(logits: torch.Tensor, p: SamplingParams, step: int) -> int | RowFailure:
    """One seeded draw from finite ``logits`` ``[V]``, or why it cannot be made."""
    try:
        gen = _generator(p.seed if p.seed is not None else 0, step)
        scaled = _filter_top_k_top_p(logits.cpu() / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(scaled, dim=-1)  # [V]
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            return RowFailure(f"sampling probabilities are not finite at temperature "
                              f"{p.temperature:g}, top_k {p.top_k}, top_p {p.top_p:g}")
        return int(torch.multinomial(probs, 1, generator=gen).item())
    except Exception as exc:  # noqa: BLE001 - one row's failure is that request's alone
        return RowFailure(f"sampling raised {type(exc).__name__}: {exc}")

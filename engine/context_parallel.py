"""Context-parallel (CP) prefill: which tokens of a step each CP rank computes, and the gathers.

Every CP rank is called with the same steps (SPMD). Each sequence's chunk is cut into
``2 * cp`` pieces and rank ``r`` computes pieces ``r`` and ``2 * cp - 1 - r``
(:func:`cp_token_slices`), balancing causal attention work. A rank runs its tokens through
every layer with all heads; the MLA latents (``c_kv``, ``k_pe``, V3.2 indexer keys) of its
tokens are all-gathered into token order (:meth:`CPStep.gather_rows`) and a piece attends
causally over the chunk up to its end plus the cached prefix (exact, LSE-merged). NOTE: after
a CP step EVERY rank's KV cache holds ALL the step's tokens, so any rank can ship any token;
each sequence's last hidden state is summed from its one owner (:meth:`CPStep.gather_last`),
so every rank returns the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.prefill_seq import PrefillSeq
from engine.parallel import CPGroup


def cp_token_slices(num_tokens: int, cp_size: int, cp_rank: int) -> tuple[range, ...]:
    """The chunk offsets CP rank ``cp_rank`` computes: ``(piece r, piece 2*cp-1-r)``, piece
    ``k`` being ``[k*T // (2cp), (k+1)*T // (2cp))`` (may be empty when T < 2cp).

    Balance: token counts differ by at most 2 and causal work (sum of ``offset + 1``) by at
    most ``2 * T`` over the ranks (a contiguous split: about ``T**2 / cp``).

    Raises:
        ValueError: negative ``num_tokens``, ``cp_size < 1`` or ``cp_rank`` outside it.
    """
    if num_tokens < 0 or cp_size < 1 or not 0 <= cp_rank < cp_size:
        raise ValueError(f"no CP slices for {num_tokens} tokens, cp_size {cp_size}, "
                         f"cp_rank {cp_rank}: need tokens >= 0 and 0 <= cp_rank < cp_size")
    n = 2 * cp_size

    def piece(k: int) -> range:
        return range(k * num_tokens // n, (k + 1) * num_tokens // n)

    return piece(cp_rank), piece(n - 1 - cp_rank)


@dataclass(frozen=True)
class CPPiece:
    """One contiguous run of a sequence's chunk that this rank computes.

    Attributes:
        seq: the sequence (rows of the FULL flattened step, context, prefix slots).
        lo, hi: the piece's chunk offsets ``[lo, hi)`` (full rows ``seq.start + lo ..``).
        local_start: the piece's first row in this rank's local tensors.
    """

    seq: PrefillSeq
    lo: int
    hi: int
    local_start: int

    @property
    def local_rows(self) -> slice:
        """Its rows in this rank's local tensors."""
        return slice(self.local_start, self.local_start + self.hi - self.lo)


@dataclass(frozen=True)
class CPStep:
    """This rank's share of one CP step (built by :func:`build_cp_step`).

    Attributes:
        group: the CP group. local_rows: ``[T_local]`` int64 full rows this rank computes.
        counts: rows of each CP rank. order: ``[T]`` int64, the row of token ``t`` in the
            rank-ordered concatenation of every rank's local rows.
        pieces: this rank's non-empty pieces, in local row order.
        last_local, last_seq: ``[B_local]`` int64 local rows that end a sequence, and which.
        num_seqs: sequences in the step.
    """

    group: CPGroup
    local_rows: torch.Tensor
    counts: tuple[int, ...]
    order: torch.Tensor
    pieces: tuple[CPPiece, ...]
    last_local: torch.Tensor
    last_seq: torch.Tensor
    num_seqs: int

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[T_local, ...]`` of every rank -> ``[T, ...]`` in the step's token order."""
        return self.group.all_gather(x, list(self.counts))[self.order]

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Local rows ``[T_local, D]`` -> ``[B, D]`` at each sequence's last token (every rank
        the same: each row has one owner, the others add zeros)."""
        out = x.new_zeros(self.num_seqs, x.shape[-1])
        out[self.last_seq] = x[self.last_local]
        return self.group.all_reduce(out)


def build_cp_step(prefills: tuple[PrefillSeq, ...], cp: CPGroup,
                  device: torch.device | str = "cpu") -> CPStep:
    """This rank's rows of a step whose sequences are all ``prefills`` (every sequence,
    1-token chunks included, is a prefill under CP), split by :func:`cp_token_slices`."""
    rows_of = [_rank_rows(prefills, cp.size, r) for r in range(cp.size)]
    concat = torch.tensor([row for rows in rows_of for row in rows], dtype=torch.int64)
    order = torch.empty_like(concat)
    order[concat] = torch.arange(concat.numel())
    pieces, local, last_local, last_seq = [], rows_of[cp.rank], [], []
    for b, seq in enumerate(prefills):
        for piece in cp_token_slices(seq.end - seq.start, cp.size, cp.rank):
            if not piece:
                continue
            start = sum(p.hi - p.lo for p in pieces)
            pieces.append(CPPiece(seq, piece.start, piece.stop, start))
            if seq.start + piece.stop == seq.end:
                last_local.append(start + len(piece) - 1)
                last_seq.append(b)
    return CPStep(group=cp, local_rows=torch.tensor(local, dtype=torch.int64, device=device),
                  counts=tuple(len(rows) for rows in rows_of), order=order.to(device),
                  pieces=tuple(pieces),
                  last_local=torch.tensor(last_local, dtype=torch.int64, device=device),
                  last_seq=torch.tensor(last_seq, dtype=torch.int64, device=device),
                  num_seqs=len(prefills))


def _rank_rows(prefills: tuple[PrefillSeq, ...], cp_size: int, cp_rank: int) -> list[int]:
    """Full rows CP rank ``cp_rank`` computes, sequence by sequence, piece by piece."""
    return [seq.start + j for seq in prefills
            for piece in cp_token_slices(seq.end - seq.start, cp_size, cp_rank) for j in piece]

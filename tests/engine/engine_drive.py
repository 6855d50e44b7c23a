"""Drive a ModelRunner like a tiny scheduler would: chunked prefill then greedy decode."""

from __future__ import annotations

import torch

from engine.runner import ModelRunner, SeqStep


def blocks_for(first_block: int, num_tokens: int, block_size: int) -> tuple[int, ...]:
    """A contiguous block table starting at ``first_block`` for ``num_tokens`` tokens."""
    return tuple(range(first_block, first_block + -(-num_tokens // block_size)))


def generate_greedy(runner: ModelRunner, prompt: list[int], max_new: int,
                    block_ids: tuple[int, ...], chunk: int | None = None,
                    request_id: str = "r") -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of every step that produced a token.

    The prompt runs in chunks of ``chunk`` tokens (one shot when None), then one token per step.
    """
    chunk = chunk or len(prompt)
    done, logits = 0, None
    while done < len(prompt):
        piece = tuple(prompt[done:done + chunk])
        logits = runner.execute([SeqStep(request_id, piece, done, block_ids)])[0]
        done += len(piece)
    out, all_logits = [], [logits]
    for _ in range(max_new):
        out.append(int(logits.argmax()))
        if len(out) == max_new:
            break
        logits = runner.execute([SeqStep(request_id, (out[-1],), done, block_ids)])[0]
        all_logits.append(logits)
        done += 1
    return out, all_logits

"""Drive a speculative ModelRunner like the leader does: chunked prefill, then draft ->
verify steps (greedy), keeping each step's DraftInput."""

from __future__ import annotations

from engine.runner import ModelRunner, SeqStep
from engine.sampling_params import SamplingParams
from engine.spec_decode import DraftInput, verify
from engine.spec_forward import SpecForward


def generate_spec_greedy(runner: ModelRunner, prompt: list[int], max_new: int,
                         block_ids: tuple[int, ...], chunk: int | None = None,
                         k: int = 1, request_id: str = "r") -> tuple[list[int], list[int]]:
    """Greedy tokens of a speculating runner, and the drafts kept per verify step."""
    chunk = chunk or len(prompt)
    done, out = 0, None
    while done < len(prompt):
        piece = tuple(prompt[done:done + chunk])
        nxt = prompt[done + len(piece)] if done + len(piece) < len(prompt) else None
        out = runner.execute([SeqStep(request_id, piece, done, block_ids, next_token_id=nxt)])
        done += len(piece)
    tokens = [int(out.logits[-1].argmax())]
    draft = DraftInput(out.hidden[0][-1:], done - 1, (tokens[-1],))
    kept = []
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new)
    while len(tokens) < max_new:
        n = min(k, max_new - len(tokens) - 1)
        out = runner.execute([SeqStep(request_id, (tokens[-1],), done, block_ids,
                                      draft=draft, num_drafts=n)])
        new = verify(out.logits, out.drafts[0], greedy, len(tokens))
        kept.append(len(new) - 1)
        draft = DraftInput(out.hidden[0][:len(new)], done, tuple(new))
        tokens.extend(new)
        done += len(new)
    return tokens[:max_new], kept


def oracle_drafts_of(monkeypatch, seqs: dict[str, list[int]], wrong_every: int = 3) -> None:
    """Drafts of request ``rid`` from ``seqs[rid]`` (prompt + the known answer), wrong
    wherever ``position % wrong_every == 0``; the MTP forwards still run."""
    real = SpecForward._draft

    def drafts(self, steps):
        out = real(self, steps)
        fixed = []
        for s, d in zip(steps, out):
            seq = seqs[s.request_id]
            fixed.append(tuple(seq[p] if p % wrong_every else (seq[p] + 1) % 129280
                               for p in range(s.num_computed_tokens + 1,
                                              s.num_computed_tokens + 1 + len(d))))
        return fixed

    monkeypatch.setattr(SpecForward, "_draft", drafts)

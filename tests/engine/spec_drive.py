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
    tokens, kept = generate_spec_greedy_batch(runner, [prompt], max_new, [block_ids], chunk,
                                              k, [request_id])
    return tokens[0], kept[0]


def generate_spec_greedy_batch(runner: ModelRunner, prompts: list[list[int]], max_new: int,
                               tables: list[tuple[int, ...]], chunk: int | None = None,
                               k: int = 1, request_ids: list[str] | None = None
                               ) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of each prompt (each prefilled alone, in ``chunk``-token steps), decoded
    together: draft -> verify steps over every unfinished request; and per request the drafts
    kept per verify step."""
    ids = request_ids or [f"r{i}" for i in range(len(prompts))]
    tokens, drafts, done = [], [], []
    for rid, prompt, table in zip(ids, prompts, tables):
        hidden, first = _prefill(runner, rid, prompt, table, chunk or len(prompt))
        tokens.append([first])
        drafts.append(DraftInput(hidden, len(prompt) - 1, (first,)))
        done.append(len(prompt))
    kept: list[list[int]] = [[] for _ in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new)
    while live := [i for i, t in enumerate(tokens) if len(t) < max_new]:
        out = runner.execute([SeqStep(ids[i], (tokens[i][-1],), done[i], tables[i],
                                      draft=drafts[i],
                                      num_drafts=min(k, max_new - len(tokens[i]) - 1))
                              for i in live])
        for b, i in enumerate(live):
            new = verify(out.logits[out.rows(b)], out.drafts[b], greedy, len(tokens[i]))
            kept[i].append(len(new) - 1)
            drafts[i] = DraftInput(out.hidden[b][:len(new)], done[i], tuple(new))
            tokens[i].extend(new)
            done[i] += len(new)
    return [t[:max_new] for t in tokens], kept


def _prefill(runner: ModelRunner, request_id: str, prompt: list[int],
             block_ids: tuple[int, ...], chunk: int):
    """Chunked prefill of one prompt: the last row's hidden state ``[1, H]`` and the greedy
    first token."""
    done, out = 0, None
    while done < len(prompt):
        piece = tuple(prompt[done:done + chunk])
        nxt = prompt[done + len(piece)] if done + len(piece) < len(prompt) else None
        out = runner.execute([SeqStep(request_id, piece, done, block_ids, next_token_id=nxt)])
        done += len(piece)
    return out.hidden[0][-1:], int(out.logits[-1].argmax())


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

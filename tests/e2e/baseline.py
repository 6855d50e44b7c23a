"""The colocated reference of the end-to-end tests, computed in this process: the engine alone
(one ModelRunner, tp 1, no router, no KV transfer) on the checkpoint a test served, greedy.

NOTE: why this and not a second `orch up configs/colocated.yaml` per checkpoint: what the PD
tests claim is "disaggregated serving computes the tokens colocated execution computes", and the
engine alone is colocated execution with nothing in between (prefill and decode in one process,
on one KV cache), so a fault of the transfer, the router or the serving stack cannot hide in the
reference. The colocated SERVING path (`orch up` in colocated mode) keeps its own end-to-end run:
the session fixture ``colocated_outputs`` (tests/e2e/conftest.py), which test_pd_end_to_end and
test_expert_parallel_up compare against, and test_bench_up. A second bring-up per checkpoint cost
~15 s of CI each (V3.2, W8A8, CP).
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.router.detokenizer import Tokenizer

BLOCK_SIZE = 16


def router_token_ids(checkpoint: Path, texts: list[str]) -> list[tuple[int, ...]]:
    """The prompt token ids the router computes for ``texts`` (orchestrator/router/validate.py)."""
    tokenizer = Tokenizer(checkpoint)
    return [tuple(tokenizer.encode(text)) for text in texts]


def engine_greedy(checkpoint: Path, prompts: list[tuple[int, ...]], max_tokens: list[int] | int,
                  chunk: int | None = 64) -> list[list[int]]:
    """Greedy output tokens of each prompt from the engine alone: each prompt prefilled on
    its own, then every unfinished request decoded in one batch per step (as colocated
    serving batches them).

    Args:
        checkpoint: the checkpoint folder the tested `orch up` served
            (``load_config(orch.config).model.checkpoint_dir()``, made by that run).
        prompts: prompt token ids.
        max_tokens: output tokens per prompt (one int: the same for every prompt).
        chunk: prefill chunk in tokens (64: long prompts go in several chunks, as a colocated
            instance with a small chunk_size runs them); None: each prompt in one step.
    """
    from engine.runner import ModelRunner, SeqStep

    counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    tables, first = [], 0
    for prompt, count in zip(prompts, counts):
        size = -(-(len(prompt) + count) // BLOCK_SIZE)
        tables.append(tuple(range(first, first + size)))
        first += size
    runner = ModelRunner(str(checkpoint), num_kv_blocks=first, block_size=BLOCK_SIZE)
    out = []
    for i, (prompt, table) in enumerate(zip(prompts, tables)):
        step = chunk or len(prompt)
        for done in range(0, len(prompt), step):
            piece = tuple(prompt[done:done + step])
            logits = runner.execute([SeqStep(f"r{i}", piece, done, table)])[0]
        out.append([int(logits.argmax())])
    while live := [i for i, tokens in enumerate(out) if len(tokens) < counts[i]]:
        steps = [SeqStep(f"r{i}", (out[i][-1],), len(prompts[i]) + len(out[i]) - 1, tables[i])
                 for i in live]
        for i, logits in zip(live, runner.execute(steps)):
            out[i].append(int(logits.argmax()))
    return out

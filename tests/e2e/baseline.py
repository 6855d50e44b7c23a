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

from orchestrator.detokenizer import Tokenizer

BLOCK_SIZE = 16
NUM_BLOCKS = 32  # x 16 tokens = 512: the max_model_len of every e2e config


def router_token_ids(checkpoint: Path, texts: list[str]) -> list[tuple[int, ...]]:
    """The prompt token ids the router computes for ``texts`` (orchestrator/validate.py)."""
    tokenizer = Tokenizer(checkpoint)
    return [tuple(tokenizer.encode(text)) for text in texts]


def engine_greedy(checkpoint: Path, prompts: list[tuple[int, ...]], max_tokens: list[int] | int,
                  chunk: int | None = 64) -> list[list[int]]:
    """Greedy output tokens of each prompt from the engine alone, one request at a time.

    Args:
        checkpoint: the checkpoint folder the tested `orch up` served
            (``load_config(orch.config).model.checkpoint_dir()``, made by that run).
        prompts: prompt token ids, each at most NUM_BLOCKS * BLOCK_SIZE - max_tokens long.
        max_tokens: output tokens per prompt (one int: the same for every prompt).
        chunk: prefill chunk in tokens (colocated.yaml's 64: long prompts go in several chunks,
            as colocated serving runs them); None: each prompt in one step.
    """
    from engine.runner import ModelRunner
    from tests.engine.engine_drive import generate_greedy

    counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    runner = ModelRunner(str(checkpoint), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    blocks = tuple(range(NUM_BLOCKS))
    return [generate_greedy(runner, list(p), n, blocks, chunk=chunk)[0]
            for p, n in zip(prompts, counts)]

"""Multi-process helpers of the DeepSeek-V4 expert-parallel tests: ``dp`` gloo ranks (tp 1,
EP rank = DP rank) serve their own requests in lockstep, started by
:func:`tests.engine.ep_ranks.run_ranks` (the fork server of tests/rank_processes.py).

Each DP rank has its own list of requests, each starting at a given step; a step batches every
live request of the rank (a prompt's one chunk next to decode tokens), and a rank with none
live calls ``execute_empty`` so the others' all-to-alls meet. Every rank runs the same number
of steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16


@dataclass(frozen=True)
class V4Plan:
    """What every rank runs in one layout.

    Attributes:
        ckpt: checkpoint directory. dp: the EP size (tp 1).
        requests: per DP rank, its requests as (prompt, start step); possibly none.
        max_new: greedy tokens per request. out_dir: where rank i writes
        ``{name}_rank{i}.pt``. port: the EP group's TCPStore.
    """

    ckpt: str
    dp: int
    requests: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]
    max_new: int
    out_dir: str
    port: int

    tp = 1

    @property
    def name(self) -> str:
        return f"v4_ep{self.dp}"

    @property
    def num_steps(self) -> int:
        return max(start for rank in self.requests for _, start in rank) + self.max_new


def drive(runner, requests: tuple[tuple[tuple[int, ...], int], ...], max_new: int,
          num_steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy-decode ``requests`` on ``runner`` for ``num_steps`` lockstep steps: per request
    its ``max_new`` tokens and ``[max_new, vocab]`` logits."""
    from engine.runner import SeqStep

    tokens: list[list[int]] = [[] for _ in requests]
    logits: list[list[torch.Tensor]] = [[] for _ in requests]
    for step in range(num_steps):
        live, steps = [], []
        for i, (prompt, start) in enumerate(requests):
            done = len(tokens[i])
            if step < start or done >= max_new:
                continue
            live.append(i)
            steps.append(SeqStep(f"r{i}", prompt, 0, (i,)) if done == 0 else
                         SeqStep(f"r{i}", (tokens[i][-1],), len(prompt) + done - 1, (i,)))
        if not steps:
            runner.execute_empty()
            continue
        for i, row in zip(live, runner.execute(steps)):
            logits[i].append(row)
            tokens[i].append(int(row.argmax()))
    return tokens, [torch.stack(rows) for rows in logits]


def v4_rank_main(index: int, plans: tuple[V4Plan, ...]) -> None:
    """Body of rank process ``index``: run every plan in turn; save its requests' tokens and
    logits and its routed-expert bytes."""
    from engine.parallel import init_ep_group
    from engine.v4.runner import V4Runner
    from tests.engine.ep_ranks import expert_bytes

    torch.set_num_threads(1)
    for plan in plans:
        ep = init_ep_group(index, plan.dp, "127.0.0.1", plan.port, timeout_s=60)
        try:
            runner = V4Runner(plan.ckpt, num_kv_blocks=8, block_size=BLOCK, ep=ep)
            tokens, logits = drive(runner, plan.requests[index], plan.max_new, plan.num_steps)
            torch.save({"tokens": tokens, "logits": logits,
                        "expert_bytes": expert_bytes(runner.model),
                        "live": runner.num_live_requests()},
                       f"{plan.out_dir}/{plan.name}_rank{index}.pt")
        finally:
            ep.destroy()

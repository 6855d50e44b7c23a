"""Multi-process helpers of the DeepSeek-V4 expert-parallel tests: ``dp x tp`` gloo ranks (EP
rank of TP rank ``r`` of DP rank ``d``: ``d * tp + r``, as orch's) serve each DP rank's
requests in lockstep, started by :func:`tests.engine.ep_ranks.run_ranks` (the fork server of
tests/rank_processes.py).

Each DP rank has its own list of requests, each starting at a given step; a step batches every
live request of the rank (a prompt's one chunk next to decode tokens), and a rank with none
live calls ``execute_empty`` so the others' all-to-alls meet. Every rank runs the same number
of steps; the TP ranks of a DP rank run the same steps (the rank's SPMD step, here by each
driving the same requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16


@dataclass(frozen=True)
class V4Plan:
    """What every rank runs in one layout.

    Attributes:
        ckpt: checkpoint directory. dp: DP ranks (EP size ``dp * tp``).
        requests: per DP rank, its requests as (prompt, start step); possibly none.
        max_new: greedy tokens per request. out_dir: where rank i writes
        ``{name}_rank{i}.pt``. port: the EP group's TCPStore. tp: TP ranks per DP rank.
        tp_ports: DP rank d's TP group's TCPStore (tp > 1).
    """

    ckpt: str
    dp: int
    requests: tuple[tuple[tuple[tuple[int, ...], int], ...], ...]
    max_new: int
    out_dir: str
    port: int
    tp: int = 1
    tp_ports: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"v4_ep{self.dp}" + (f"_tp{self.tp}" if self.tp > 1 else "")

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
    """Body of rank process ``index`` (EP rank; DP rank ``index // tp``, TP rank ``index %
    tp``): run every plan in turn; save its DP rank's requests' tokens and logits and its
    routed-expert bytes."""
    from engine.parallel import init_ep_group, init_tp_group
    from engine.v4.runner import V4Runner
    from tests.engine.ep_ranks import expert_bytes

    torch.set_num_threads(1)
    for plan in plans:
        dp_rank, tp_rank = divmod(index, plan.tp)
        tp = init_tp_group(tp_rank, plan.tp, "127.0.0.1", plan.tp_ports[dp_rank],
                           timeout_s=60) if plan.tp > 1 else None
        ep = init_ep_group(index, plan.dp * plan.tp, "127.0.0.1", plan.port, timeout_s=60)
        try:
            runner = V4Runner(plan.ckpt, num_kv_blocks=8, block_size=BLOCK, tp=tp, ep=ep)
            tokens, logits = drive(runner, plan.requests[dp_rank], plan.max_new,
                                   plan.num_steps)
            torch.save({"tokens": tokens, "logits": logits,
                        "expert_bytes": expert_bytes(runner.model),
                        "live": runner.num_live_requests()},
                       f"{plan.out_dir}/{plan.name}_rank{index}.pt")
        finally:
            ep.destroy()
            if tp is not None:
                tp.destroy()

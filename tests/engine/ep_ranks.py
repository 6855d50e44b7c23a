"""Multi-process helpers of the expert-parallel tests: run dp x tp gloo ranks in lockstep.

One spawn of ``n`` processes runs several layouts of ``n`` ranks one after the other (the
processes start once: on 2 cores that is most of the time). In each layout process ``i`` is
EP rank ``i``: DP rank ``i // tp``, TP rank ``i % tp``. Each DP rank greedily decodes its own
request; a DP rank whose request has not started yet (or has finished) calls
``execute_empty`` so the others' EP collectives meet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp

from tests.rank_processes import START_METHOD

BLOCK = 16


@dataclass(frozen=True)
class Plan:
    """What every rank runs in one layout.

    Attributes:
        ckpt: checkpoint directory. dp, tp: the layout (EP size dp * tp).
        prompts: one prompt per DP rank. starts: the step at which DP rank d's request
            starts (it is idle before and after). max_new: greedy tokens per request.
        out_dir: where rank i writes ``{name}_rank{i}.pt``. ports: [EP store, TP store of
            DP 0..].
    """

    ckpt: str
    dp: int
    tp: int
    prompts: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    max_new: int
    out_dir: str
    ports: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"dp{self.dp}xtp{self.tp}"

    @property
    def num_steps(self) -> int:
        return max(self.starts) + self.max_new


def expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the routed-expert parameters of ``model``."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".mlp.experts." in n)


def rank_main(index: int, plans: tuple[Plan, ...]) -> None:
    """Body of spawned process ``index``: run every plan in turn."""
    torch.set_num_threads(1)
    for plan in plans:
        _run_plan(index, plan)


def _run_plan(index: int, plan: Plan) -> None:
    """Decode DP rank ``index // tp``'s request in lockstep; save its tokens, per-step logits
    and routed-expert bytes."""
    from engine.parallel import ep_rank_of, init_ep_group, init_tp_group
    from engine.runner import ModelRunner

    dp_rank, tp_rank = divmod(index, plan.tp)
    tp = init_tp_group(tp_rank, plan.tp, "127.0.0.1", plan.ports[1 + dp_rank], timeout_s=60)
    ep = init_ep_group(ep_rank_of(dp_rank, tp_rank, plan.tp), plan.dp * plan.tp, "127.0.0.1",
                       plan.ports[0], timeout_s=60)
    try:
        runner = ModelRunner(plan.ckpt, num_kv_blocks=8, block_size=BLOCK, tp=tp, ep=ep)
        tokens, logits = _decode_in_lockstep(runner, plan, dp_rank)
        torch.save({"tokens": tokens, "logits": torch.stack(logits),
                    "expert_bytes": expert_bytes(runner.model)},
                   f"{plan.out_dir}/{plan.name}_rank{index}.pt")
    finally:
        ep.destroy()
        tp.destroy()


def _decode_in_lockstep(runner, plan: Plan,
                        dp_rank: int) -> tuple[list[int], list[torch.Tensor]]:
    from engine.runner import SeqStep

    prompt, start = plan.prompts[dp_rank], plan.starts[dp_rank]
    blocks = tuple(range(-(-(len(prompt) + plan.max_new) // BLOCK)))
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for step in range(plan.num_steps):
        if not start <= step < start + plan.max_new:
            runner.execute_empty()
            continue
        if step == start:
            seq = SeqStep("r", prompt, 0, blocks)
        else:
            seq = SeqStep("r", (tokens[-1],), len(prompt) + len(tokens) - 1, blocks)
        row = runner.execute([seq])[0]
        logits.append(row)
        tokens.append(int(row.argmax()))
    return tokens, logits


def run_ranks(plans: tuple, timeout_s: float = 120.0, main=rank_main) -> dict[str, list[dict]]:
    """Spawn ``dp * tp`` processes (the same for every plan), run the plans in turn (each
    process ``main(index, plans)``; default: :class:`Plan`'s), wait (bounded); plan name ->
    each rank's results (``{out_dir}/{name}_rank{i}.pt``)."""
    n = plans[0].dp * plans[0].tp
    assert all(p.dp * p.tp == n for p in plans), "every plan needs the same number of ranks"
    ctx = mp.start_processes(main, args=(plans,), nprocs=n, join=False,
                             start_method=START_METHOD)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{n} ranks did not finish {[p.name for p in plans]} in "
                            f"{timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return {p.name: [torch.load(f"{p.out_dir}/{p.name}_rank{i}.pt") for i in range(n)]
            for p in plans}

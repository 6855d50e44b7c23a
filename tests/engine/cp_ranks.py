"""Multi-process helper of the context-parallel tests: ``n`` gloo CP ranks run several plans
over one CP group (the processes and the group start once: on 2 cores that is most of the
time). Each plan builds a runner, prefills (:func:`run_plan`), and saves the logits, the KV
caches and the bytes of the layer-sharded weights of every rank."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.multiprocessing as mp

from tests.rank_processes import START_METHOD

BLOCK = 16


@dataclass(frozen=True)
class CPPlan:
    """What every rank runs: ``prompt`` prefilled in ``chunks`` (token counts), or as two
    batched requests (``batched``, :func:`prefill_two`), with ``layer_sharding``, with expert
    parallelism over the CP ranks when ``ep``, attending to earlier keys in tiles of
    ``prefix_tile``, with the MTP module (``mtp``: speculative decoding's prefill side);
    results go to ``{out_dir}/{name}_rank{i}.pt``."""

    name: str
    ckpt: str
    prompt: tuple[int, ...]
    chunks: tuple[int, ...]
    layer_sharding: tuple[str, ...] = ()
    ep: bool = False
    batched: bool = False
    prefix_tile: int = 4096
    mtp: bool = False


def blocks_for(num_tokens: int, first: int = 0) -> tuple[int, ...]:
    return tuple(range(first, first + -(-num_tokens // BLOCK)))


def run_plan(runner, plan: CPPlan) -> torch.Tensor:
    """The plan's logits: ``[vocab]`` after ``prefill``, or ``[4, vocab]`` of the two batched
    steps of :func:`prefill_two`."""
    if plan.batched:
        return prefill_two(runner, plan.prompt)
    return prefill(runner, plan.prompt, plan.chunks)


def num_blocks(plan: CPPlan) -> int:
    return len(blocks_for(len(plan.prompt))) + 2  # prefill_two's second table starts anew


def prefill_two(runner, prompt: tuple[int, ...]) -> torch.Tensor:
    """Two requests batched: step 1 = request a's 700 tokens + request b's first 100; step 2
    = b's remaining tokens + one more token of a (a 1-token chunk with context). Logits
    ``[4, vocab]`` (both steps, in step order)."""
    from engine.runner import SeqStep

    a, b = prompt[:700], prompt[700:]
    table_a = blocks_for(len(a) + 1)
    table_b = blocks_for(len(b), first=len(table_a))
    first = runner.execute([SeqStep("a", a, 0, table_a), SeqStep("b", b[:100], 0, table_b)])
    second = runner.execute([SeqStep("b", b[100:], 100, table_b),
                             SeqStep("a", (7,), len(a), table_a)])
    return torch.cat((first, second))


def prefill(runner, prompt: tuple[int, ...], chunks: tuple[int, ...]) -> torch.Tensor:
    """Logits ``[vocab]`` after the prompt ran in ``chunks`` (a speculative runner: the
    logits then the last prompt row's kept hidden state, ``[vocab + hidden]``)."""
    from engine.runner import SeqStep
    from engine.spec_decode import SpecOutput

    done, blocks, out = 0, blocks_for(len(prompt)), None
    for n in chunks:
        nxt = prompt[done + n] if done + n < len(prompt) else None
        out = runner.execute([SeqStep("r", prompt[done:done + n], done, blocks,
                                      next_token_id=nxt)])
        done += n
    assert done == len(prompt), "chunks must cover the prompt"
    return torch.cat((out.logits[-1], out.hidden[0][-1])) if isinstance(out, SpecOutput) \
        else out[0]


def sharded_bytes(model: torch.nn.Module, names: tuple[str, ...]) -> int:
    """Bytes of the attention weights named ``names`` that ``model`` stores."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n.split(".")[-2] in names and ".self_attn." in n)


def caches_of(runner) -> list[torch.Tensor]:
    return [b.clone() for i in range(runner.kv_spec.num_layers)
            for b in runner.kv_cache.layer_buffers(i)]


def rank_main(index: int, size: int, ports: tuple[int, int], plans: tuple[CPPlan, ...],
              out_dir: str) -> None:
    """Body of spawned process ``index``: join the CP group (``ports[0]``) and the EP group
    over the same ranks (``ports[1]``), run every plan in turn."""
    from engine.attention import MLAttention
    from engine.parallel import EPGroup, init_cp_group, init_ep_group
    from engine.runner import ModelRunner

    torch.set_num_threads(1)
    cp = init_cp_group(index, size, "127.0.0.1", ports[0], timeout_s=60)
    ep = init_ep_group(index, size, "127.0.0.1", ports[1], timeout_s=60)
    try:
        for plan in plans:
            MLAttention.prefix_tile = plan.prefix_tile
            runner = ModelRunner(plan.ckpt, num_kv_blocks=num_blocks(plan),
                                 block_size=BLOCK, cp=cp, layer_sharding=plan.layer_sharding,
                                 ep=ep if plan.ep else EPGroup(),
                                 num_speculative_tokens=int(plan.mtp))
            logits = run_plan(runner, plan)
            stats = vars(runner.prefetcher.stats) if runner.prefetcher is not None else None
            torch.save({"logits": logits, "caches": caches_of(runner), "stats": stats,
                        "sharded_bytes": sharded_bytes(runner.model, ("q_b_proj", "o_proj"))},
                       f"{out_dir}/{plan.name}_rank{index}.pt")
    finally:
        ep.destroy()
        cp.destroy()


def run_cp_ranks(size: int, ports: tuple[int, int], plans: tuple[CPPlan, ...], out_dir: str,
                 timeout_s: float = 120.0) -> dict[str, list[dict]]:
    """Spawn ``size`` CP ranks, run ``plans``, wait (bounded); plan name -> rank results."""
    ctx = mp.start_processes(rank_main, args=(size, ports, plans, out_dir), nprocs=size,
                             join=False, start_method=START_METHOD)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"{size} CP ranks did not finish in {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    return {p.name: [torch.load(f"{out_dir}/{p.name}_rank{i}.pt") for i in range(size)]
            for p in plans}

"""TP=2 (two gloo processes, TCPStore rendezvous) gives the same logits as TP=1."""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from engine.runner import ModelRunner, SeqStep
from tests.ports import free_port as _free_port
from tests.rank_processes import START_METHOD

BLOCK = 16
PROMPT = tuple(range(1000, 1040))


def _scenario(runner: ModelRunner) -> torch.Tensor:
    """Chunked prefill of one request, then a step mixing its decode with another prefill."""
    rows = [runner.execute([SeqStep("a", PROMPT[:16], 0, (0, 1, 2))])]
    rows.append(runner.execute([SeqStep("a", PROMPT[16:], 16, (0, 1, 2))]))
    rows.append(runner.execute([SeqStep("a", (5,), 40, (0, 1, 2)),
                                SeqStep("b", PROMPT[:9], 0, (3,))]))
    return torch.cat(rows)  # [4, vocab]


def _rank_main(rank: int, port: int, ckpts: list[str], out_dir: str) -> None:
    from engine.parallel import init_tp_group

    torch.set_num_threads(1)
    tp = init_tp_group(rank, 2, "127.0.0.1", port, "gloo", timeout_s=60)
    try:
        for i, ckpt in enumerate(ckpts):
            runner = ModelRunner(ckpt, num_kv_blocks=8, block_size=BLOCK, tp=tp)
            assert runner.model.model.layers[0].self_attn.num_local_heads == 2
            torch.save(_scenario(runner), f"{out_dir}/rank{rank}_ckpt{i}.pt")
    finally:
        tp.destroy()


def test_tp2_equals_tp1(tiny_ckpt, tiny_ckpt_no_qlora, tiny_dsa_ckpt, tmp_path):
    """V3, plain q_proj, and V3.2 (40-token prompt > index_topk: the replicated indexer must
    select the same tokens on both ranks)."""
    ckpts = [str(tiny_ckpt), str(tiny_ckpt_no_qlora), str(tiny_dsa_ckpt)]
    ctx = mp.start_processes(_rank_main, args=(_free_port(), ckpts, str(tmp_path)), nprocs=2,
                             join=False, start_method=START_METHOD)
    deadline = time.monotonic() + 120
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail("TP=2 ranks did not finish within 120 s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert all(not p.is_alive() for p in ctx.processes)
    for i, ckpt in enumerate(ckpts):
        ref = _scenario(ModelRunner(ckpt, num_kv_blocks=8, block_size=BLOCK))
        for rank in (0, 1):
            got = torch.load(tmp_path / f"rank{rank}_ckpt{i}.pt")
            diff = (got - ref).abs().max().item()
            assert diff <= 1e-5, f"ckpt {i} rank {rank}: max |diff| {diff}"


def test_tp_group_of_one_is_trivial():
    from engine.parallel import init_tp_group

    tp = init_tp_group(0, 1)
    x = torch.ones(3)
    assert tp.group is None and tp.all_reduce(x) is x and x.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="TCPStore port"):
        init_tp_group(0, 2, port=0)

"""DeepSeek-V4 expert parallelism (engine/v4/expert_parallel.py) over gloo rank processes: each
DP rank serves its own requests with only its routed experts (hash-routed layers 0-1 too), in
lockstep with the others, idle ranks included, at tp 1 and with TP (EP over dp x tp); every
request's greedy tokens and logits are transformers' ``DeepseekV4ForCausalLM``'s. And each EP
rank reads only its experts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.parallel import EPGroup
from engine.v4.loader import load_v4
from tests.engine.ep_ranks import expert_bytes, run_ranks
from tests.engine.v4_ep_ranks import V4Plan
from tests.ports import free_port

MAX_NEW = 32
TOL = 1e-4


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 129000, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


# NOTE: per DP rank (prompt, start step): DP 0 batches two requests (the second's prompt next
# to the first's decode tokens), DP 1 is idle for 5 steps; at ep 4 DP 2 never has work
EP2 = (((_prompt(21, 0), 0), (_prompt(6, 1), 3)), ((_prompt(13, 2), 5),))
EP4 = EP2 + ((), ((_prompt(9, 3), 1),))


@pytest.fixture(scope="module")
def hf(tiny_v4_ckpt):
    from transformers import DeepseekV4ForCausalLM  # noqa: PLC0415 (reference only)

    return DeepseekV4ForCausalLM.from_pretrained(tiny_v4_ckpt, dtype=torch.float32,
                                                 attn_implementation="eager").eval()


def _check_against_hf(hf, prompt: tuple[int, ...], tokens: list[int], logits: torch.Tensor,
                      where: str) -> None:
    """transformers' one-shot logits over prompt + tokens[:-1] at the generated positions:
    within TOL of ours, and their argmax is our every token (so greedy ``generate`` gives
    these tokens)."""
    ids = torch.tensor(prompt + tuple(tokens[:-1]))[None]
    with torch.no_grad():
        want = hf(ids).logits[0, len(prompt) - 1:].float()
    diff = (logits - want).abs().max().item()
    assert diff <= TOL, f"{where}: max |logit diff| {diff}"
    assert tokens == want.argmax(-1).tolist(), where


@pytest.mark.parametrize(("requests", "tp", "max_new"),
                         [(EP2, 1, MAX_NEW), (EP4, 1, 8), (EP2, 2, 8)],
                         ids=["ep2", "ep4", "dp2xtp2"])
def test_ep_ranks_equal_transformers(tiny_v4_ckpt, hf, requests, tp, max_new, tmp_path):
    """ep 2 (32 tokens a request), ep 4 (8: 4 processes on 2 cores cost) and dp 2 x tp 2 with
    ep (EP 4; 8 tokens; both TP ranks of a DP rank drive its requests, each dispatching half
    of the tokens) over rank processes, DP 0 with two requests, an idle DP rank; each rank
    holds 8 / (dp x tp) of the 8 experts, whole: every request's tokens and logits, on every
    TP rank, as transformers'."""
    plan = V4Plan(str(tiny_v4_ckpt), len(requests), requests, max_new, str(tmp_path),
                  free_port(), tp, tuple(free_port() for _ in requests) if tp > 1 else ())
    from tests.engine.v4_ep_ranks import v4_rank_main  # noqa: PLC0415

    results = run_ranks((plan,), main=v4_rank_main)[plan.name]
    assert len(results) == plan.dp * tp
    total = expert_bytes(hf)  # NOTE: transformers names its experts as ours
    for rank, got in enumerate(results):
        mine = requests[rank // tp]
        assert got["expert_bytes"] * plan.dp * tp == total, f"rank {rank}"
        assert got["live"] == len(mine)
        for i, (prompt, _) in enumerate(mine):
            assert len(got["tokens"][i]) == max_new
            _check_against_hf(hf, prompt, got["tokens"][i], got["logits"][i],
                              f"{plan.name} rank {rank} request {i}")


def _recording_get(monkeypatch) -> set[str]:
    import engine.v4.loader  # noqa: PLC0415

    read, get = set(), engine.v4.loader.get_tensor

    def recording(key, where):
        read.add(key)
        return get(key, where)
    monkeypatch.setattr(engine.v4.loader, "get_tensor", recording)
    return read


def test_an_ep_rank_reads_and_holds_only_its_experts(tiny_v4_ckpt, monkeypatch):
    """DeepSeek naming (per-expert tensors): EP rank 1 of 4 reads experts 2 and 3 of 8 in
    every layer and nothing else of the experts; every tensor equals the full model's
    (its experts: rows 2-3)."""
    full = load_v4(tiny_v4_ckpt).state_dict()
    read = _recording_get(monkeypatch)
    model = load_v4(tiny_v4_ckpt, ep=EPGroup(rank=1, size=4))  # loading needs no collectives
    experts = {k for k in read if ".ffn.experts." in k}
    assert {k.split(".")[4] for k in experts} == {"2", "3"}
    assert len(experts) == 4 * 2 * 3  # layers x experts x (w1, w2, w3)
    for name, tensor in model.state_dict().items():
        want = full[name][2:4] if ".mlp.experts." in name else full[name]
        assert torch.equal(tensor, want), name


def test_fused_expert_tensors_are_read_by_rows(tiny_v4_ckpt, tmp_path):
    """transformers naming (fused ``experts.gate_up_proj [E, 2I, h]``, here in a second file
    next to the DeepSeek-named one; the loader prefers it): EP rank 3 of 4 gets rows 6-7."""
    full = load_v4(tiny_v4_ckpt).state_dict()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in tiny_v4_ckpt.iterdir():
        (ckpt / f.name).symlink_to(f)
    fused = {k: v.clone() for k, v in full.items() if ".mlp.experts." in k}
    fused["model.layers.0.mlp.experts.down_proj"][7] += 1.0  # NOTE: shows which file was read
    save_file(fused, str(ckpt / "z-experts.safetensors"))
    model = load_v4(ckpt, ep=EPGroup(rank=3, size=4)).state_dict()
    for name in fused:
        assert torch.equal(model[name], fused[name][6:8]), name
    with pytest.raises(ValueError, match=r"dp\*tp\*cp=3 does not divide n_routed_experts=8"):
        load_v4(tiny_v4_ckpt, ep=EPGroup(rank=0, size=3))


def test_v4_ep_ranks_brought_up_by_init_rank_step_in_lockstep(tiny_v4_ckpt):
    """Two colocated V4 DP ranks (dp 2 x tp 1, ep; threads of this process) brought up as orch
    does (``open_ep_store``, ``init_rank`` with the EP store): the rank builds the V4 runner
    with its EP group (4 of 8 experts each) and the DP sync; a request on one while the other
    idles, then one on each, give the tokens of one EP-off runner; every V4 block back."""
    from dataclasses import replace  # noqa: PLC0415
    import threading  # noqa: PLC0415

    from engine.v4.runner import V4Runner  # noqa: PLC0415
    from rank.colocated import ColocatedRole  # noqa: PLC0415
    from rank.config import (InstanceConfig, ParallelConfig,  # noqa: PLC0415
                             SchedulerConfig)
    from rank.rank import Rank  # noqa: PLC0415
    from tests.engine.test_v4_runner import _collect, _generate, _prompt  # noqa: PLC0415
    from tests.engine.v4_ep_ranks import drive  # noqa: PLC0415

    seeds = {"a": (17, 0), "b": (6, 1)}  # request -> (prompt tokens, seed)
    solo = V4Runner(tiny_v4_ckpt, num_kv_blocks=8, block_size=16)
    tokens, _ = drive(solo, tuple((_prompt(*seeds[rid]), 0) for rid in seeds), 6, 6)
    want = dict(zip(seeds, tokens))
    scheduler = SchedulerConfig(block_size=16, num_kv_blocks=16, chunk_size=8,
                                max_num_batched_tokens=20, max_num_seqs=4, prefix_cache=False)
    ranks = [Rank(InstanceConfig(
        name=f"colocated-{i}", role="colocated", checkpoint_dir=str(tiny_v4_ckpt),
        scheduler=scheduler, parallel=ParallelConfig(tp=1, dp=2, dp_rank=i, ep=True,
                                                     step_timeout_s=60.0)), 0, ColocatedRole)
        for i in range(2)]
    host, port = ranks[0].open_ep_store()
    threads = [threading.Thread(target=r.init_rank, args=("127.0.0.1", 0, [r], (host, port)))
               for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(r.runner, V4Runner) and r.dp_sync is not None for r in ranks)
    assert [r.runner.model.model.layers[0].mlp.experts.expert_ids for r in ranks] == [
        range(0, 4), range(4, 8)]
    for r in ranks:
        r.start()
    try:
        ranks[0].request(_generate("a", *seeds["a"], max_tokens=6))
        assert _collect(ranks[0], {"a": ([], None, None)})["a"] == (want["a"], "length", None)
        for r, rid in zip(ranks, ("b", "a")):
            r.request(_generate(rid, *seeds[rid], max_tokens=6))
        assert _collect(ranks[0], {"b": ([], None, None)})["b"] == (want["b"], "length", None)
        assert _collect(ranks[1], {"a": ([], None, None)})["a"] == (want["a"], "length", None)
        assert all(r.leader.broken is None for r in ranks)
    finally:
        for r in ranks:
            r.shutdown()
    for r in ranks:
        r.runner.apply_releases()
        assert all(p.num_free_blocks == p.num_blocks for p in r.runner.pools.values())

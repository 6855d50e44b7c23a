"""Context-parallel prefill over 4 gloo ranks (fp32): the same logits and KV caches as one
rank, one shot and chunked, DeepSeek-V3, V3.2 and GLM-5.2-style, with the MTP module;
layer-sharded attention
weights stored 1/4 per rank with unchanged logits; the load-balanced causal token split."""

from __future__ import annotations

import pytest
import torch

from engine.context_parallel import cp_token_slices
from engine.layer_sharding import LayerPrefetcher, layer_sharding_bytes
from engine.model_config import load_model_config
from engine.parallel import CPGroup, TPGroup, init_cp_group
from engine.runner import ModelRunner
from orchestrator.tiny_model import write_tiny_checkpoint
from tests.engine.cp_ranks import BLOCK, CPPlan, caches_of, num_blocks, run_cp_ranks, \
    run_plan, sharded_bytes
from tests.ports import free_port

CP = 4
SHARDED = ("q_b_proj", "o_proj")
CHUNKS = (600, 421, 2, 1)  # the short chunks leave some ranks without tokens


@pytest.fixture(scope="module")
def cp_ckpt(tmp_path_factory):
    """4 layers (1 dense, 3 MoE): each of the 4 CP ranks owns one layer's sharded weights."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_cp"), seed=5, num_layers=4)


@pytest.fixture(scope="module")
def cp_mtp_ckpt(tmp_path_factory):
    """2 layers (1 dense, 1 MoE) and an MoE MTP module."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_cp_mtp"), seed=5, num_layers=2,
                                 mtp_layers=1)


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


def _one_rank(plan: CPPlan) -> dict:
    runner = ModelRunner(plan.ckpt, num_kv_blocks=num_blocks(plan), block_size=BLOCK,
                         num_speculative_tokens=int(plan.mtp))
    return {"logits": run_plan(runner, plan), "caches": caches_of(runner),
            "sharded_bytes": sharded_bytes(runner.model, SHARDED)}


def _max_diff(got: dict, want: dict) -> tuple[float, float]:
    logits = (got["logits"] - want["logits"]).abs().max().item()
    caches = max((a - b).abs().max().item()
                 for a, b in zip(got["caches"], want["caches"], strict=True))
    return logits, caches


def test_cp4_prefill_equals_one_rank(cp_ckpt, tiny_dsa_ckpt, tiny_glm_shared_ckpt, cp_mtp_ckpt,
                                     tmp_path):
    """1K-token prompt in one shot and in chunks (V3; earlier keys in tiles of 100), as two
    batched requests, with layer sharding, with expert parallelism over the 4 CP ranks
    (chunked), a V3.2 prompt in 2 chunks (its indexer keys gathered too) and the same on
    GLM-5.2-style shared indexer layers, layer-sharded, and with the MTP module over the
    prompt (3 chunks, the last leaving ranks without rows; EP; its cache is one more layer;
    the kept hidden state too): every
    rank's logits and whole KV cache equal one rank's."""
    long, short = _prompt(1024, 0), _prompt(300, 1)
    plans = (CPPlan("one_shot", str(cp_ckpt), long, (1024,)),
             CPPlan("chunked", str(cp_ckpt), long, CHUNKS, prefix_tile=100),
             CPPlan("batched", str(cp_ckpt), long, (), batched=True),
             CPPlan("sharded", str(cp_ckpt), long, (1024,), SHARDED),
             CPPlan("ep", str(cp_ckpt), long, CHUNKS, ep=True),
             CPPlan("dsa", str(tiny_dsa_ckpt), short, (173, 127)),
             CPPlan("glm_shared", str(tiny_glm_shared_ckpt), short, (173, 127), SHARDED),
             CPPlan("mtp", str(cp_mtp_ckpt), short, (171, 127, 2), ep=True, mtp=True))
    results = run_cp_ranks(CP, (free_port(), free_port()), plans, str(tmp_path))
    want = {plan.name: _one_rank(plan) for plan in plans if plan.name not in ("sharded", "ep")}
    want["sharded"], want["ep"] = want["one_shot"], want["chunked"]
    for plan in plans:
        for rank, got in enumerate(results[plan.name]):
            logits, caches = _max_diff(got, want[plan.name])
            assert logits <= 1e-5 and caches <= 1e-5, f"{plan.name} rank {rank}: max |diff| " \
                f"logits {logits}, caches {caches}"
    total, per_layer = want["one_shot"]["sharded_bytes"], want["one_shot"]["sharded_bytes"] // 4
    for rank, got in enumerate(results["sharded"]):
        assert abs(got["sharded_bytes"] * CP - total) <= per_layer * CP, f"rank {rank}"
        assert torch.equal(got["logits"], results["one_shot"][rank]["logits"]), f"rank {rank}"
        stats = got["stats"]  # one forward of 4 layers, 3 of them received
        assert (stats["layers"], stats["bytes_received"]) == (4, 3 * per_layer), f"rank {rank}"
        assert 0 <= stats["wait_s"] <= stats["forward_s"], f"rank {rank}"


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4, 8])
def test_cp_token_slices_cover_once_and_balance_causal_work(cp_size):
    for n in (0, 1, 5, 2 * cp_size, 1000, 1024):
        slices = [cp_token_slices(n, cp_size, r) for r in range(cp_size)]
        tokens = sorted(j for pieces in slices for piece in pieces for j in piece)
        assert tokens == list(range(n)), f"{n} tokens over cp {cp_size}"
        counts = [sum(len(p) for p in pieces) for pieces in slices]
        work = [sum(j + 1 for p in pieces for j in p) for pieces in slices]
        assert max(counts) - min(counts) <= 2
        assert max(work) - min(work) <= 2 * n, f"work per rank {work}"
    # a contiguous split of 1024 tokens over 4 ranks is ~6x less balanced than the bound
    contiguous = [sum(j + 1 for j in range(r * 256, (r + 1) * 256)) for r in range(4)]
    assert max(contiguous) - min(contiguous) > 100 * 1024


def test_cp_token_slices_reject_bad_arguments():
    with pytest.raises(ValueError, match="0 <= cp_rank < cp_size"):
        cp_token_slices(10, 2, 2)


def test_cp_refuses_tp_with_the_fix(cp_ckpt):
    cp = CPGroup(rank=0, size=2)  # refused before any collective
    with pytest.raises(ValueError, match="runs tp=1 .* set tp to 1"):
        ModelRunner(cp_ckpt, num_kv_blocks=1, block_size=BLOCK, cp=cp, tp=TPGroup(0, 2))


def test_layer_sharding_stores_layer_i_on_cp_rank_i_mod_4(cp_ckpt):
    """Built with a CP group of 4 (no collectives at build): each rank stores exactly its
    layer's sharded weights, equal to the checkpoint's, and the memory plan's figures."""
    full = dict(ModelRunner(cp_ckpt, num_kv_blocks=1, block_size=BLOCK).model
                .named_parameters())
    total, config = sharded_bytes_of(full), load_model_config(cp_ckpt)
    for rank in range(CP):
        runner = ModelRunner(cp_ckpt, num_kv_blocks=1, block_size=BLOCK,
                             cp=CPGroup(rank=rank, size=CP), layer_sharding=SHARDED)
        params = dict(runner.model.named_parameters())
        assert sharded_bytes_of(params) * CP == total
        for name in SHARDED:
            key = f"model.layers.{rank}.self_attn.{name}.weight"
            assert torch.equal(params[key], full[key]), key
        assert (sharded_bytes_of(params), runner.prefetcher.pool_bytes) == \
            layer_sharding_bytes(config, SHARDED, CP, rank, 4)


def sharded_bytes_of(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for n, p in params.items()
               if n.split(".")[-2] in SHARDED)


def test_layer_sharding_names_attention_linears_only(cp_ckpt):
    with pytest.raises(ValueError, match=r"layer_sharding names \['gate_proj'\]"):
        ModelRunner(cp_ckpt, num_kv_blocks=1, block_size=BLOCK, layer_sharding=("gate_proj",))
    with pytest.raises(ValueError, match=r"\['q_proj'\], which this model \(q_lora_rank=48\) "
                                         "does not have; drop them"):
        ModelRunner(cp_ckpt, num_kv_blocks=1, block_size=BLOCK, cp=CPGroup(rank=1, size=CP),
                    layer_sharding=("q_proj",))


def test_prefetcher_needs_two_buffer_sets(cp_ckpt):
    layers = ModelRunner(cp_ckpt, num_kv_blocks=1, block_size=BLOCK).model.model.layers
    with pytest.raises(ValueError, match="use at least 2"):
        LayerPrefetcher(layers, SHARDED, CPGroup(rank=0, size=CP), torch.float32,
                        torch.device("cpu"), pool_size=1)


def test_cp_group_of_one_is_trivial():
    cp = init_cp_group(0, 1)
    x = torch.ones(3, 2)
    assert cp == CPGroup() and cp.all_gather(x) is x and cp.broadcast(x, 0) is None

"""Expert parallelism over dp x tp gloo ranks and vocab-parallel embedding / lm_head: the same
logits and greedy tokens as TP 1, each rank holding exactly its share of the routed experts."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import KERNELS
from engine.layout import tp_layout
from engine.loader import load_weights
from engine.model import build_model
from engine.model_config import ModelConfig, load_model_config
from engine.parallel import EPGroup, TPGroup, init_ep_group
from engine.runner import ModelRunner
from orchestrator.tiny_model import tiny_config_dict, write_tiny_checkpoint
from tests.engine.engine_drive import generate_greedy
from tests.engine.ep_ranks import BLOCK, Plan, expert_bytes, run_ranks
from tests.ports import free_port

MAX_NEW = 32
VOCAB = 1001  # odd: the last TP shard of embed_tokens / lm_head is padded
PROMPTS = ((1000, 17, 256, 99, 5, 731, 42), (3, 14, 159, 265, 358), (900, 800, 7),
           (11, 22, 33, 44, 55, 66, 77, 88, 99))


@pytest.fixture(scope="module")
def ep_ckpt(tmp_path_factory):
    """8 routed experts (the default tiny config), 2 MoE layers, a small odd vocabulary."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ep"), seed=3, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def reference(ep_ckpt):
    """TP 1, EP off: per prompt, (greedy tokens, [MAX_NEW, vocab] logits); the expert bytes."""
    runner = ModelRunner(ep_ckpt, num_kv_blocks=8, block_size=BLOCK)
    runs = []
    for prompt in PROMPTS:
        blocks = tuple(range(-(-(len(prompt) + MAX_NEW) // BLOCK)))
        tokens, logits = generate_greedy(runner, list(prompt), MAX_NEW, blocks)
        runs.append((tokens, torch.stack(logits)))
    return runs, expert_bytes(runner.model)


def test_ep4_equals_tp1_as_dp2xtp2_and_dp4xtp1(ep_ckpt, reference, tmp_path):
    """DP ranks start at different steps, so each layout has idle DP ranks (execute_empty)
    before and after their request while the others decode."""
    runs, total_bytes = reference
    plans = tuple(Plan(str(ep_ckpt), dp, tp, PROMPTS[:dp], starts, MAX_NEW, str(tmp_path),
                       tuple(free_port() for _ in range(1 + dp)))
                  for dp, tp, starts in ((2, 2, (0, 5)), (4, 1, (0, 2, 0, 9))))
    results = run_ranks(plans)
    for plan in plans:
        for index, got in enumerate(results[plan.name]):
            dp_rank, where = index // plan.tp, f"{plan.name} rank {index}"
            want_tokens, want_logits = runs[dp_rank]
            assert got["expert_bytes"] * 4 == total_bytes, where
            diff = (got["logits"] - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{where}: max |logit diff| {diff}"
            assert got["tokens"] == want_tokens, where


def test_vocab_shards_cover_the_vocabulary_and_pad_with_zeros(ep_ckpt):
    full = ModelRunner(ep_ckpt, num_kv_blocks=1, block_size=BLOCK).model
    cfg = load_model_config(ep_ckpt)
    shards = []
    for rank in (0, 1):
        tp = TPGroup(rank=rank, size=2)  # loading needs no collectives
        model = build_model(cfg, tp, KERNELS.resolve("cpu"), torch.float32, torch.device("cpu"))
        load_weights(model, ep_ckpt, tp)
        assert model.lm_head.weight.shape[0] == (VOCAB + 1) // 2
        shards.append((model.model.embed_tokens.weight, model.lm_head.weight))
    for i, want in enumerate((full.model.embed_tokens.weight, full.lm_head.weight)):
        joined = torch.cat([shard[i] for shard in shards])
        assert torch.equal(joined[:VOCAB], want)
        assert not joined[VOCAB:].any()  # the one padding row


def test_an_ep_rank_reads_and_holds_only_its_experts(ep_ckpt, monkeypatch):
    import engine.loader

    entries, read = engine.loader._checkpoint_entries, set()

    def recording_reader(name, reader):
        def read_and_record(index):
            read.add(name)
            return reader(index)
        return read_and_record

    def recording(checkpoint_dir):
        for name, shape, reader in entries(checkpoint_dir):
            yield name, shape, recording_reader(name, reader)
    monkeypatch.setattr(engine.loader, "_checkpoint_entries", recording)
    full = ModelRunner(ep_ckpt, num_kv_blocks=1, block_size=BLOCK).model.state_dict()
    ep = EPGroup(rank=1, size=4)  # loading needs no collectives
    read.clear()
    model = build_model(load_model_config(ep_ckpt), TPGroup(), KERNELS.resolve("cpu"),
                        torch.float32, torch.device("cpu"), ep=ep)
    load_weights(model, ep_ckpt, TPGroup())
    experts = {n for n in read if ".mlp.experts." in n}
    assert {n.split(".")[5] for n in experts} == {"2", "3"}  # experts 2, 3 of 8: rank 1 of 4
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, full[name]), name


def test_uneven_experts_name_the_fix():
    config = ModelConfig.from_dict(tiny_config_dict())  # 8 routed experts
    with pytest.raises(ValueError, match=r"dp\*tp\*cp=3 does not divide n_routed_experts=8 "
                       r".*one of \[1, 2, 4, 8\], or turn expert parallelism off"):
        tp_layout(config, 1, ep_size=3, ep_rank=0)
    assert tp_layout(config, 2, ep_size=4, ep_rank=3).experts == range(6, 8)


def test_ep_group_of_one_is_trivial():
    ep = init_ep_group(0, 1)
    x = torch.ones(3, 2)
    assert ep == EPGroup() and ep.all_to_all_rows(x, [3], [3]) is x
    with pytest.raises(ValueError, match="TCPStore port"):
        init_ep_group(0, 2, port=0)

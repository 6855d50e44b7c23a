"""MTP speculative decoding with graph mode: the verify step (1 + k one-token rows per
sequence) and the MTP draft forwards run the captured buckets (in tokens, ``b * (1 + k)``),
padded with rows that write only the scratch block; greedy output equals MTP eager and MTP
off token for token, with a pass-through capture backend and with inductor."""

from __future__ import annotations

import pytest
import torch

from engine import graph as graph_mod
from engine.graph import GraphBackendRegistry, GraphConfig
from engine.runner import ModelRunner
from orchestrator.tiny_model import write_tiny_checkpoint
from tests.engine.engine_drive import blocks_for, generate_greedy
from tests.engine.spec_drive import generate_spec_greedy_batch, oracle_drafts_of
from tests.engine.graph_fakes import CountingCapture

BLOCK, BLOCKS = 4, 40
PROMPTS = [[3, 5, 7, 11, 13], [17, 19, 23], [29, 31, 37, 41, 43, 47, 53]]
NEW = 9


@pytest.fixture
def counting(monkeypatch):
    """A registry whose "counting" backend runs the forward as is and counts calls."""
    registry, counting = GraphBackendRegistry(), CountingCapture()
    registry.register("compile", ("cpu",), graph_mod._load_compile, default=True)
    registry.register("counting", ("cpu",), lambda: counting)
    monkeypatch.setattr(graph_mod, "GRAPH_BACKENDS", registry)
    return counting


@pytest.fixture(scope="module")
def mtp_moe_ckpt(tmp_path_factory):
    """2 dense layers + an MoE MTP layer, small vocabulary."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec_graph"), seed=6, num_layers=2,
                                 first_k_dense_replace=2, vocab_size=512, mtp_layers=1)


@pytest.fixture(scope="module")
def mtp_v32_ckpt(tmp_path_factory):
    """DeepSeek-V3.2, 2 layers + the MTP layer (its own indexer), top-8 selection: the
    contexts here exceed it."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec_graph_v32"), seed=3,
                                 num_layers=2, vocab_size=512, mtp_layers=1, deepseek_v32=True,
                                 index_topk=8)


@pytest.fixture(scope="module")
def mtp_dense_ckpt(tmp_path_factory):
    """1 dense layer + a dense MTP layer, small vocabulary: cheap to compile."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec_graph_dense"), seed=6,
                                 num_layers=1, first_k_dense_replace=2, vocab_size=512,
                                 mtp_layers=1)


def _tables(n: int) -> list[tuple[int, ...]]:
    per = BLOCKS // n
    return [blocks_for(i * per, per * BLOCK, BLOCK) for i in range(n)]


def _plain(ckpt, prompts) -> list[list[int]]:
    runner = ModelRunner(ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK)
    return [generate_greedy(runner, p, NEW, t)[0] for p, t in zip(prompts, _tables(3))]


def _spec(ckpt, prompts, k: int, graph: GraphConfig | None = None):
    runner = ModelRunner(ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK,
                         num_speculative_tokens=k, graph=graph)
    tokens, kept = generate_spec_greedy_batch(runner, prompts, NEW, _tables(3), k=k)
    return runner, tokens, kept


@pytest.mark.parametrize("ckpt_name, k", [("mtp_moe_ckpt", 1), ("mtp_moe_ckpt", 2),
                                         ("mtp_v32_ckpt", 2)])
def test_captured_verify_and_draft_equal_eager_and_mtp_off(ckpt_name, k, counting,
                                                           monkeypatch, request):
    """Three sequences decoded together (acceptance from oracle drafts, some wrong), buckets
    (1, 4) sequences = (1 + k, 4 + 4k) tokens: every verify and draft forward is captured,
    padded, and the padding writes no pool block; V3.2 too (padding rows' selections)."""
    ckpt = request.getfixturevalue(ckpt_name)
    ref = _plain(ckpt, PROMPTS)
    oracle_drafts_of(monkeypatch, {f"r{i}": p + r for i, (p, r) in enumerate(zip(PROMPTS, ref))})
    eager, want, _ = _spec(ckpt, PROMPTS, k)
    graph, got, kept = _spec(ckpt, PROMPTS, k, GraphConfig(
        enabled=True, batch_sizes=(1, 4), backend="counting"))
    assert got == want == ref
    assert any(n > 0 for steps in kept for n in steps)  # some drafts were kept
    assert graph.graphs.config.batch_sizes == (1 + k, 4 + 4 * k)
    steps = max(len(s) for s in kept)  # NOTE: one verify and 1..k draft forwards each
    assert 2 * steps <= counting.calls <= (1 + k) * steps
    assert graph.graphs.capture_s and graph.spec.draft_graphs.capture_s
    assert not graph.graphs.failed and not graph.spec.draft_graphs.failed
    for layer in range(eager.kv_spec.num_layers):  # NOTE: the MTP layer's included
        for a, b in zip(eager.kv_cache.layer_buffers(layer), graph.kv_cache.layer_buffers(layer)):
            torch.testing.assert_close(b[:BLOCKS], a, rtol=0, atol=1e-5)


def test_inductor_spec_graphs_equal_mtp_off_without_recompiling(mtp_dense_ckpt, monkeypatch):
    """torch.compile (inductor), one bucket (1 sequence = 2 tokens, k = 1): warmup compiles
    the verify and the draft forward once each, then a whole greedy generation (rows of 1 and
    2 tokens, every context length new) runs captured without recompiling."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    prompt = PROMPTS[2]
    ref = _plain(mtp_dense_ckpt, [prompt])
    oracle_drafts_of(monkeypatch, {"r0": prompt + ref[0]})
    runner = ModelRunner(mtp_dense_ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK,
                         num_speculative_tokens=1, graph=GraphConfig(
                             enabled=True, batch_sizes=(1,), warmup=True, backend="compile"))
    assert runner.graphs.status() == runner.spec.draft_graphs.status() == {
        "captured": [2], "eager": {}}
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, kept = generate_spec_greedy_batch(runner, [prompt], NEW, _tables(3)[:1], k=1)
    assert got == ref and sum(kept[0]) > 0
    assert not runner.graphs.failed and not runner.spec.draft_graphs.failed

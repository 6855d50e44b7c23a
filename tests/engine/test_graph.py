"""Graph mode for decode: padded captured steps equal eager, padding writes only the scratch
block, non-decode steps run eager, a failing capture falls back to eager with one warning,
and the inductor capture equals eager within 1e-5 without recompiling per context length."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import graph as graph_mod
from engine.graph import GraphBackendRegistry, GraphConfig
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from tests.engine.graph_fakes import CountingCapture

BLOCK, BLOCKS = 4, 24
PROMPTS = [[3, 5, 7, 11, 13], [17, 19], [23, 29, 31, 37, 41, 43, 47]]
TABLES = [(0, 1, 2, 3), (5, 6, 7, 8), (10, 11, 12, 13)]


@pytest.fixture
def backends(monkeypatch):
    """A fresh registry holding the real backends plus "counting" and "failing" (cpu)."""
    registry = GraphBackendRegistry()
    registry.register("compile", ("cpu",), graph_mod._load_compile, default=True)
    counting, failing = CountingCapture(), CountingCapture(fail=True)
    registry.register("counting", ("cpu",), lambda: counting)
    registry.register("failing", ("cpu",), lambda: failing)
    monkeypatch.setattr(graph_mod, "GRAPH_BACKENDS", registry)
    return {"counting": counting, "failing": failing}


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory):
    """2 dense layers, small vocabulary: cheap to compile."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("graph"), seed=4, num_layers=2,
                                 first_k_dense_replace=2, vocab_size=512)


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """1 dense + 1 MoE layer (float experts: the grouped-GEMM path), small vocabulary."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("graph_moe"), seed=4, num_layers=2,
                                 first_k_dense_replace=1, vocab_size=512)


def _runners(ckpt, backend: str, buckets=(4,), **kwargs) -> tuple[ModelRunner, ModelRunner]:
    eager = ModelRunner(ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK)
    graph = ModelRunner(ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK, graph=GraphConfig(
        enabled=True, batch_sizes=buckets, backend=backend, **kwargs))
    return eager, graph


def _decode_side_by_side(eager: ModelRunner, graph: ModelRunner, num_seqs: int,
                         steps: int) -> float:
    """Prefill ``num_seqs`` prompts on both, then ``steps`` greedy decode steps of all of
    them; the largest |logit difference| over the decode steps."""
    for r in (eager, graph):
        for i in range(num_seqs):
            r.execute([SeqStep(f"r{i}", tuple(PROMPTS[i]), 0, TABLES[i])])
    lens, toks, worst = [len(p) for p in PROMPTS], [1, 2, 3], 0.0
    for _ in range(steps):
        batch = [SeqStep(f"r{i}", (toks[i],), lens[i], TABLES[i]) for i in range(num_seqs)]
        want, got = eager.execute(batch), graph.execute(batch)
        assert got.shape == want.shape
        worst = max(worst, (got - want).abs().max().item())
        toks, lens = want.argmax(-1).tolist(), [n + 1 for n in lens]
    return worst


def _assert_pool_blocks_equal(eager: ModelRunner, graph: ModelRunner) -> None:
    """Every block a pool can hand out holds the same KV on both (padding wrote none)."""
    for layer in range(eager.kv_spec.num_layers):
        for want, got in zip(eager.kv_cache.layer_buffers(layer),
                             graph.kv_cache.layer_buffers(layer), strict=True):
            assert got.shape[0] == BLOCKS + 1  # the scratch block
            torch.testing.assert_close(got[:BLOCKS], want, rtol=0, atol=1e-5)


def test_padded_decode_equals_eager_and_writes_only_scratch(dense_ckpt, backends):
    eager, graph = _runners(dense_ckpt, "counting")
    assert graph.kv_cache.scratch_block == BLOCKS and eager.kv_cache.scratch_block is None
    assert _decode_side_by_side(eager, graph, num_seqs=3, steps=4) <= 1e-5
    counting = backends["counting"]
    assert (counting.captures, counting.calls) == (1, 4)  # prefills ran eager, decodes captured
    assert graph.graph_modes() == (("decode", "captured [4]"),)
    _assert_pool_blocks_equal(eager, graph)
    scratch = graph.kv_cache.k_caches[0][BLOCKS]
    assert scratch.abs().sum() > 0  # the padding row's KV went there


def test_mixed_and_oversized_steps_run_eager(dense_ckpt, backends):
    _, graph = _runners(dense_ckpt, "counting", buckets=(1, 2))
    prefill = SeqStep("p", (3, 4), 0, (20,))
    graph.execute([prefill])
    decode = [SeqStep(f"d{i}", (5,), 2, (20 + i,)) for i in range(3)]
    graph.execute(decode[:1] + [SeqStep("q", (3, 4), 0, (22,))])  # mixed
    graph.execute(decode)  # 3 > the largest bucket
    assert backends["counting"].calls == 0
    graph.execute(decode[:2])
    assert backends["counting"].calls == 1 and set(graph.graphs.capture_s) == {2}


def test_warmup_captures_every_bucket_and_touches_no_pool_block(dense_ckpt, backends):
    _, graph = _runners(dense_ckpt, "counting", buckets=(1, 2, 4), warmup=True)
    assert set(graph.graphs.capture_s) == {1, 2, 4} and backends["counting"].calls == 3
    assert all(c[:BLOCKS].abs().sum() == 0 for c in graph.kv_cache.k_caches)


def test_failing_capture_falls_back_to_eager_with_one_warning(dense_ckpt, backends, caplog):
    eager, graph = _runners(dense_ckpt, "failing")
    with caplog.at_level(logging.WARNING, logger="engine.graph"):
        assert _decode_side_by_side(eager, graph, num_seqs=2, steps=3) <= 1e-5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "bucket 4 falls back to eager" in warnings[0]
    assert graph.graphs.failed == {4} and backends["failing"].calls == 1
    assert graph.graph_modes() == (("decode", "captured []; eager 4 (RuntimeError: backend "
                                              "exploded)"),)
    assert graph.graphs.bucket_for([1, 1], [5, 6]) is None  # later steps go straight to eager
    _assert_pool_blocks_equal(eager, graph)


@pytest.mark.parametrize("ckpt_name", ["tiny_dsa_ckpt", "tiny_glm_shared_ckpt"])
def test_padded_decode_equals_eager_dsa(ckpt_name, backends, request):
    """V3.2, and GLM-5.2-style shared indexer layers (the padding rows' selections reused)."""
    eager, graph = _runners(request.getfixturevalue(ckpt_name), "counting")
    assert _decode_side_by_side(eager, graph, num_seqs=2, steps=3) <= 1e-5
    assert backends["counting"].calls == 3
    _assert_pool_blocks_equal(eager, graph)


def test_inductor_capture_equals_eager_without_recompiling(moe_ckpt, backends, monkeypatch):
    """torch.compile (inductor) on a dense + a MoE layer in fp32: bucket 4 compiles to ONE
    graph (attention and the grouped experts are opaque ops, no break), and new context
    lengths (S changes every step) must not recompile."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    eager, graph = _runners(moe_ckpt, "compile")
    graphs_before = counters["stats"]["unique_graphs"]
    assert _decode_side_by_side(eager, graph, num_seqs=3, steps=1) <= 1e-5
    assert set(graph.graphs.capture_s) == {4} and not graph.graphs.failed
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # no graph break
    with torch._dynamo.config.patch(error_on_recompile=True):
        lens = [len(p) + 1 for p in PROMPTS]
        for step in range(3):
            batch = [SeqStep(f"r{i}", (7 + step,), lens[i] + step, TABLES[i]) for i in range(3)]
            got, want = graph.execute(batch), eager.execute(batch)
            assert (got - want).abs().max().item() <= 1e-5
    assert not graph.graphs.failed  # a recompile would have raised and fallen back


def test_inductor_warmup_is_the_graph_real_steps_use(dense_ckpt, backends, monkeypatch):
    """After warmup the first real decode step of a bucket must not compile again (the
    warmup's padding-only step once had a one-block table: a size-1 specialization)."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    eager, graph = _runners(dense_ckpt, "compile", buckets=(2,), warmup=True)
    assert set(graph.graphs.capture_s) == {2}
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert _decode_side_by_side(eager, graph, num_seqs=2, steps=2) <= 1e-5
    assert not graph.graphs.failed  # a recompile would have raised and fallen back


def test_warmup_reports_a_bucket_that_cannot_be_captured(dense_ckpt, backends, caplog):
    """A failed capture is listed in the graph status and named by one ERROR line at
    start-up (warmup), not hidden."""
    with caplog.at_level(logging.INFO):
        _, graph = _runners(dense_ckpt, "failing", buckets=(1, 2), warmup=True)
    assert graph.graphs.status() == {"captured": [], "eager": {
        1: "RuntimeError: backend exploded", 2: "RuntimeError: backend exploded"}}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "buckets [1, 2] run EAGER" in errors[0], errors


def test_required_graph_mode_refuses_a_bucket_that_cannot_be_captured(dense_ckpt, backends):
    with pytest.raises(graph_mod.GraphCaptureError, match=r"bucket 1 cannot be captured "
                       r"\(RuntimeError: backend exploded\).*decode.graph.required false"):
        _runners(dense_ckpt, "failing", buckets=(1, 2), warmup=True, required=True)


def test_warmup_with_every_bucket_captured_says_so(dense_ckpt, backends, caplog):
    with caplog.at_level(logging.INFO, logger="engine.runner"):
        _, graph = _runners(dense_ckpt, "counting", buckets=(1, 2), warmup=True)
    assert graph.graphs.status() == {"captured": [1, 2], "eager": {}}
    assert any("every decode bucket captured: [1, 2]" in r.getMessage()
               for r in caplog.records)


def test_inductor_capture_runs_the_prepared_lm_head_gemm(dense_ckpt, backends, monkeypatch):
    """A captured step of 2+ rows runs the oneDNN-packed lm_head GEMM as the opaque op
    ``orch::onednn_lm_head`` (not a traced F.linear, not an eager fallback), and its logits
    stay within 1e-5 of eager with no recompile."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    eager, graph = _runners(dense_ckpt, "compile", buckets=(2,), warmup=True)
    assert set(graph.graphs.capture_s) == {2}
    for r in (eager, graph):
        for i in range(2):
            r.execute([SeqStep(f"r{i}", tuple(PROMPTS[i]), 0, TABLES[i])])
    batch = [SeqStep(f"r{i}", (5,), len(PROMPTS[i]), TABLES[i]) for i in range(2)]
    with torch._dynamo.config.patch(error_on_recompile=True), \
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = graph.execute(batch)
    ops = {event.name for event in prof.events()}
    assert "orch::onednn_lm_head" in ops and "mkldnn::_linear_pointwise" in ops, sorted(ops)
    assert (got - eager.execute(batch)).abs().max().item() <= 1e-5
    assert not graph.graphs.failed


def test_inductor_bucket_takes_cached_and_padded_steps_without_recompiling(dense_ckpt, backends,
                                                                         monkeypatch):
    """A bucket's steps come two ways: exactly ``bucket`` sequences (metadata from the
    decode-step cache, its table updated in place) and fewer (padding rows: the general
    builder); neither may recompile the captured graph, and both equal eager."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    eager, graph = _runners(dense_ckpt, "compile", buckets=(2,), warmup=True)
    prompts, tables = PROMPTS[:2], TABLES[:2]
    for r in (eager, graph):
        for i, prompt in enumerate(prompts):
            r.execute([SeqStep(f"r{i}", tuple(prompt), 0, tables[i])])
    lens = [len(p) for p in prompts]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(6):  # NOTE: 2, 2, 1, 2, 2, 1 sequences; contexts cross a block
            n = 1 if step % 3 == 2 else 2
            batch = [SeqStep(f"r{i}", (3 + step,), lens[i], tables[i]) for i in range(n)]
            got, want = graph.execute(batch), eager.execute(batch)
            assert (got - want).abs().max().item() <= 1e-5
            lens = [c + 1 if i < n else c for i, c in enumerate(lens)]
    assert graph._decode_cache.rebuilds >= 1  # the cached path ran
    assert not graph.graphs.failed  # a recompile would have raised and fallen back

"""Graph mode for prefill: the inductor capture equals eager (logits and KV) for every
prefill-only step shape after one compile (one or several prompts, a chunk after a cached
prefix, two tokens); decode rows, one-token steps and layer-by-layer sends run eager; a
failing capture falls back to eager (or raises when required); layouts without a capture are
refused with the fix."""

from __future__ import annotations

import pytest
import torch

from engine import prefill_graph as pg
from engine.graph import GraphBackendRegistry, GraphCaptureError
from engine.prefill_graph import PrefillGraphConfig, pack_prefills, unpack_prefills
from engine.prefill_seq import PrefillSeq
from engine.runner import ModelRunner, SeqStep
from orchestrator.tiny_model import write_tiny_checkpoint
from tests.engine.graph_fakes import CountingCapture

BLOCK, BLOCKS = 4, 40


def _ids(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed))
                 .tolist())


A, B, C = _ids(1, 37), _ids(2, 9), _ids(3, 30)
# NOTE: every prefill-only shape the graph must serve without compiling again: one prompt;
# two prompts of other lengths; a second chunk after a cached prefix beside a new prompt;
# two tokens (the fewest it takes)
STEPS = [
    [SeqStep("a", A, 0, tuple(range(10)))],
    [SeqStep("b", B, 0, (10, 11, 12)), SeqStep("c", C[:13], 0, tuple(range(13, 21)))],
    [SeqStep("c", C[13:], 13, tuple(range(13, 21))), SeqStep("d", B[:5], 0, (21, 22))],
    [SeqStep("e", (7, 9), 0, (23,))],
]


@pytest.fixture
def backends(monkeypatch):
    """A fresh registry: the real "compile" plus "counting" and "failing" (cpu)."""
    registry = GraphBackendRegistry()
    registry.register("compile", ("cpu",), pg._load_dynamic_compile, default=True)
    counting, failing = CountingCapture(), CountingCapture(fail=True)
    registry.register("counting", ("cpu",), lambda: counting)
    registry.register("failing", ("cpu",), lambda: failing)
    monkeypatch.setattr(pg, "PREFILL_GRAPH_BACKENDS", registry)
    return {"counting": counting, "failing": failing}


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """1 dense + 1 MoE layer (the grouped-GEMM experts), small vocabulary: cheap to compile."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("prefill_graph"), seed=4,
                                 num_layers=2, first_k_dense_replace=1, vocab_size=512)


def _runner(ckpt, **graph) -> ModelRunner:
    config = PrefillGraphConfig(enabled=True, **graph) if graph else None
    return ModelRunner(ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK, prefill_graph=config)


def _assert_kv_equal(eager: ModelRunner, graph: ModelRunner) -> None:
    """Every block the pool hands out holds the same KV on both."""
    for layer in range(eager.kv_spec.num_layers):
        for want, got in zip(eager.kv_cache.layer_buffers(layer),
                             graph.kv_cache.layer_buffers(layer), strict=True):
            assert got.shape[0] == BLOCKS + 1  # the scratch block
            torch.testing.assert_close(got[:BLOCKS], want, rtol=0, atol=1e-5)


def test_compiled_prefill_equals_eager_for_every_shape_after_one_compile(moe_ckpt):
    eager, graph = _runner(moe_ckpt), _runner(moe_ckpt, warmup=True)
    assert graph.prefill_graph.status() == {"captured": True, "eager": None}
    assert graph.graph_modes() == (("prefill", "captured"),) and eager.graph_modes() == ()
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for step in STEPS:
        want, got = eager.execute(step), graph.execute(step)
        assert got.shape == want.shape == (len(step), 512)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    # NOTE: no shape above compiled again (a count, a length or a prefix is data to the op)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
    _assert_kv_equal(eager, graph)


def test_steps_the_graph_cannot_take_run_eager(moe_ckpt, backends):
    eager, graph = _runner(moe_ckpt), _runner(moe_ckpt, backend="counting", warmup=False)
    counting = backends["counting"]
    prompt = SeqStep("p", A[:6], 0, (0, 1))
    for r in (eager, graph):
        r.execute([prompt])
    assert counting.calls == 1
    steps = [[SeqStep("p", (5,), 6, (0, 1)), SeqStep("q", B[:4], 0, (2,))],  # a decode row
             [SeqStep("r", (8,), 0, (3,))]]  # one token
    for step in steps:
        torch.testing.assert_close(graph.execute(step), eager.execute(step), rtol=0, atol=0)
    layers = []
    sent = SeqStep("s", B, 0, (4, 5, 6))
    torch.testing.assert_close(graph.execute([sent], on_kv_written=layers.append),
                               eager.execute([sent]), rtol=0, atol=0)
    assert layers == [0, 1]  # NOTE: layer by layer: every layer's callback, in order
    assert counting.calls == 1  # none of them went through the graph
    _assert_kv_equal(eager, graph)


def test_failed_capture_runs_eager_with_the_reason(moe_ckpt, backends):
    eager, graph = _runner(moe_ckpt), _runner(moe_ckpt, backend="failing", warmup=False)
    assert graph.graph_modes() == (("prefill", "not captured yet"),)
    step = STEPS[1]
    torch.testing.assert_close(graph.execute(step), eager.execute(step), rtol=0, atol=0)
    assert graph.prefill_graph.status() == {
        "captured": False, "eager": "RuntimeError: backend exploded"}
    assert graph.graph_modes() == (("prefill", "eager (RuntimeError: backend exploded)"),)
    graph.execute(STEPS[0])
    assert backends["failing"].calls == 1  # NOTE: tried once, then eager for good


def test_failed_capture_with_required_names_the_fix(moe_ckpt, backends):
    with pytest.raises(GraphCaptureError, match=r"prefill graph mode is required.*backend "
                                                r"exploded.*prefill\.graph\.required false"):
        _runner(moe_ckpt, backend="failing", required=True, warmup=True)


def test_speculative_decoding_is_refused(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, seed=4, num_layers=2, vocab_size=512, mtp_layers=1)
    with pytest.raises(ValueError, match=r"prefill graph mode does not run with speculative "
                                         r"decoding.*set prefill\.graph\.enabled false"):
        ModelRunner(ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK, num_speculative_tokens=1,
                    prefill_graph=PrefillGraphConfig(enabled=True))


def test_sparse_attention_is_refused(tiny_dsa_ckpt):
    with pytest.raises(ValueError, match=r"DSA sparse attention"):
        ModelRunner(tiny_dsa_ckpt, num_kv_blocks=BLOCKS, block_size=BLOCK,
                    prefill_graph=PrefillGraphConfig(enabled=True))


def test_pack_holds_every_sequence_and_is_never_a_specialized_size():
    seqs = [PrefillSeq(0, 5, 0, torch.empty(0, dtype=torch.int64)),
            PrefillSeq(5, 9, 3, torch.tensor([40, 41, 42])),
            PrefillSeq(9, 10, 2, torch.tensor([7, 8]))]
    got = unpack_prefills(pack_prefills(seqs))
    assert [(s, e, p.tolist()) for s, e, p in got] == [(0, 5, []), (5, 9, [40, 41, 42]),
                                                       (9, 10, [7, 8])]
    assert pack_prefills(seqs[:1]).numel() == 5  # the fewest: B = 1, no prefix

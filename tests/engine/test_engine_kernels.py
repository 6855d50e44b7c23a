"""Platform detection, the kernel registry, reshape_and_cache, the lm_head GEMM, and the MoE
router maths."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

import torch.nn.functional as F

from engine.kernels import KERNELS, KernelRegistry, reshape_and_cache_torch
from engine import lm_head_gemm
from engine.lm_head_gemm import PACKED_MIN_ROWS
from engine.model_config import ModelConfig
from engine.moe import MoEGate
from engine.platform import detect_platform
from tests.engine.test_engine_model_config import V3


def test_cpu_platform_and_env_override(monkeypatch):
    assert detect_platform("cpu").dist_backend == "gloo"
    monkeypatch.setenv("ORCH_DEVICE", "tpu")
    with pytest.raises(ValueError, match="ORCH_DEVICE"):
        detect_platform()
    if "torch_npu" not in sys.modules:
        with pytest.raises(RuntimeError, match="torch_npu"):
            detect_platform("npu")


def test_registry_resolves_defaults_lazily_and_names_unknowns():
    ks = KERNELS.resolve("cpu")
    assert ks.reshape_and_cache is reshape_and_cache_torch
    assert ks.mla_decode.__name__ == "decode_absorbed"
    assert KERNELS.resolve("cpu", {"mla_decode": "naive"}).mla_decode.__name__ == "decode_naive"
    with pytest.raises(KeyError, match="registered: \\['absorbed', 'flashinfer', 'naive', "):
        KERNELS.resolve("cpu", {"mla_decode": "flash"})
    with pytest.raises(KeyError, match="unknown kernels"):
        KERNELS.resolve("cpu", {"paged_attention": "x"})
    assert "torch_npu" not in sys.modules  # nothing imported torch_npu so far
    reg = KernelRegistry()
    reg.register("k", "v", ("cpu",), lambda: "impl")
    with pytest.raises(KeyError, match="no 'cuda' implementation"):
        reg.get("k", "cuda")


@pytest.mark.parametrize("layout", ["hidden_major", "vocab_major"])
def test_lm_head_gemm_equals_linear(layout):
    """Every lm_head variant equals F.linear at 0..17 rows, over the [H, V] storage
    build_model gives lm_head and over a tied embedding's [V, H] one; the CPU default packs
    from PACKED_MIN_ROWS rows (a different GEMM: equal to fp32 rounding, same argmax)."""
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 1000, 64
    weight = torch.randn(hidden, vocab, generator=gen).t() if layout == "hidden_major" \
        else torch.randn(vocab, hidden, generator=gen)
    gemms = {v: KERNELS.get("lm_head", "cpu", v)(weight) for v in ("native", "torch")}
    for rows in (0, 1, PACKED_MIN_ROWS, 3, 8, 17):
        x = torch.randn(rows, hidden, generator=gen)
        want = F.linear(x, weight)
        for variant, gemm in gemms.items():
            got = gemm(x)
            assert got.shape == (rows, vocab) and got.dtype == torch.float32, variant
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1)), (variant, rows)
    half = weight.to(torch.float16)  # NOTE: not fp32: the plain GEMM, whatever the rows
    x = torch.randn(4, hidden, generator=gen).to(torch.float16)
    assert torch.equal(KERNELS.get("lm_head", "cpu")(half)(x), F.linear(x, half))


def test_compiled_lm_head_gemm_is_one_opaque_op_and_its_packed_copy_goes_with_it(monkeypatch):
    """Under torch.compile (inductor) the packed CPU GEMM is the op orch::onednn_lm_head,
    equal to the eager GEMM; one row traces F.linear; the packed copy is dropped with its
    GEMM."""
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
    before = set(lm_head_gemm._PACKED)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 1000, generator=gen).t()  # [V, H] view of [H, V], as build_model
    gemm = KERNELS.get("lm_head", "cpu", "native")(weight)
    (key,) = set(lm_head_gemm._PACKED) - before
    compiled = torch.compile(lambda x: gemm(x) * 2.0, backend="inductor", dynamic=False)
    for rows in (4, 1):
        x = torch.randn(rows, 64, generator=gen)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = compiled(x)
        ops = {event.name for event in prof.events()}
        assert ("orch::onednn_lm_head" in ops) == (rows >= PACKED_MIN_ROWS), (rows, sorted(ops))
        torch.testing.assert_close(got, 2.0 * gemm(x), rtol=1e-6, atol=1e-6)
    del gemm, compiled
    torch._dynamo.reset()  # NOTE: dynamo's caches hold the compiled closure
    gc.collect()
    assert key not in lm_head_gemm._PACKED


def test_reshape_and_cache_writes_exactly_the_slots():
    k_cache, v_cache = torch.zeros(4, 2, 3), torch.zeros(4, 2, 1)
    k = torch.arange(9, dtype=torch.float32).view(3, 3) + 1
    v = torch.tensor([[10.0], [20.0], [30.0]])
    reshape_and_cache_torch((k, v), (k_cache, v_cache), torch.tensor([5, 0, 6]))
    flat = k_cache.view(8, 3)
    assert flat[5].tolist() == [1, 2, 3] and flat[0].tolist() == [4, 5, 6]
    assert v_cache.view(8).tolist() == [20, 0, 0, 0, 0, 10, 30, 0]


def _gate(**over) -> MoEGate:
    cfg = ModelConfig.from_dict({**V3, "hidden_size": 8, "n_routed_experts": 16,
                                 "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                                 **over})
    gate = MoEGate(cfg)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))
    return gate


def _reference_route(gate: MoEGate, x: torch.Tensor):
    """REFERENCE.md router, one token at a time, in plain Python."""
    cfg = gate.config
    out = []
    for row in x:
        s = torch.sigmoid(gate.weight @ row).tolist()
        b = [si + bi for si, bi in zip(s, gate.e_score_correction_bias.tolist())]
        per = len(b) // cfg.n_group
        gscore = [sum(sorted(b[g * per:(g + 1) * per])[-2:]) for g in range(cfg.n_group)]
        groups = sorted(range(cfg.n_group), key=lambda g: -gscore[g])[:cfg.topk_group]
        cand = [e for e in range(len(b)) if e // per in groups]
        top = sorted(cand, key=lambda e: -b[e])[:cfg.num_experts_per_tok]
        w = [s[e] for e in top]
        out.append({e: wi / sum(w) * cfg.routed_scaling_factor for e, wi in zip(top, w)})
    return out


def test_sigmoid_group_limited_router_matches_reference():
    gate = _gate()
    with torch.no_grad():  # strongly negative bias: 0-masking would pick dropped groups
        gate.e_score_correction_bias.copy_(-3 + torch.randn(16, generator=torch.Generator()
                                                             .manual_seed(1)))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    weights, ids = gate(x)
    for t, ref in enumerate(_reference_route(gate, x)):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert got.keys() == ref.keys()
        assert all(got[e] == pytest.approx(ref[e], rel=1e-5) for e in ref)
    assert weights.sum(-1).allclose(torch.full((32,), 2.5))


def test_softmax_v2_router_without_bias():
    gate = _gate(scoring_func="softmax", topk_method="group_limited_greedy",
                 norm_topk_prob=False, routed_scaling_factor=1.0)
    assert gate.e_score_correction_bias is None
    x = torch.randn(5, 8)
    weights, ids = gate(x)
    probs = torch.softmax(x @ gate.weight.T, dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids))
    groups = ids // 4  # 16 experts in 4 groups
    best = probs.view(5, 4, 4).max(-1).values.topk(2, dim=-1).indices
    assert all(set(groups[t].tolist()) <= set(best[t].tolist()) for t in range(5))
